"""The connector's ``tenant`` setting (kv_connector_extra_config, KVTIER_VLLM_TENANT): parsed,
overridden by the environment, and a name that cannot travel as gRPC metadata refused at start.
Pure parsing: no vLLM, no daemon."""

from __future__ import annotations

import pytest

from kvstore.errors import ConfigError
from kvstore.integrations.vllm.config import ConnectorConfig


def test_tenant_from_extra_config_and_environment() -> None:
    assert ConnectorConfig.from_extra_config({"daemon": "h:1"}, {}).tenant == ""
    cfg = ConnectorConfig.from_extra_config({"daemon": "h:1", "tenant": " acme "}, {})
    assert cfg.tenant == "acme"  # surrounding spaces are trimmed, as for every text key
    cfg = ConnectorConfig.from_extra_config({"daemon": "h:1", "tenant": "acme"},
                                            {"KVTIER_VLLM_TENANT": "globex"})
    assert cfg.tenant == "globex"  # the environment wins
    cfg = ConnectorConfig.from_extra_config({"daemon": "h:1"}, {"KVTIER_VLLM_TENANT": "t-1.x"})
    assert cfg.tenant == "t-1.x"
    assert ConnectorConfig.from_extra_config(
        {"daemon": "h:1", "tenant": "x" * 128}, {}).tenant == "x" * 128


@pytest.mark.parametrize("bad", ["x" * 129, "caf\u00e9", "a\tb", "line\nbreak"])
def test_a_tenant_that_cannot_be_sent_is_refused_at_start(bad: str) -> None:
    with pytest.raises(ConfigError, match="'tenant' must be printable ASCII"):
        ConnectorConfig.from_extra_config({"daemon": "h:1", "tenant": bad}, {})
    with pytest.raises(ConfigError, match="'tenant' must be printable ASCII"):
        ConnectorConfig.from_extra_config({"daemon": "h:1"}, {"KVTIER_VLLM_TENANT": bad})


def test_a_tenant_that_is_not_text_is_refused() -> None:
    with pytest.raises(ConfigError, match="bad value 7 for 'tenant'"):
        ConnectorConfig.from_extra_config({"daemon": "h:1", "tenant": 7}, {})

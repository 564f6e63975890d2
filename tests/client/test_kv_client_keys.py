"""KVClient in both hash modes against a real daemon: save/load round trips, keys in the
SHA256_CBOR mode equal vLLM's own block hashes (golden vectors produced by vLLM's code, see
tests/test_keys.py), a connector's block hashes map to keys without rehashing, and the
namespace still separates models, tenants and tensor-parallel ranks."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import replace

import cbor2
import pytest

torch = pytest.importorskip("torch")

from kvstore.client.kv_client import KVClient, KVClientConfig  # noqa: E402
from kvstore.client.kvlayout import KVLayout, namespace_for  # noqa: E402
from kvstore.client.layouts import ContiguousKV  # noqa: E402
from kvstore.client.requests import BlockKeys  # noqa: E402
from kvstore.client.store_client import DataPlane  # noqa: E402
from kvstore.errors import InvalidArgument  # noqa: E402
from kvstore.keys import HashMode  # noqa: E402
from tests.support.daemon import DaemonProcess  # noqa: E402
from tests.test_keys import VLLM_GOLDEN  # noqa: E402

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=16, dtype=torch.float16)
B = LAYOUT.block_tokens
SHA = KVClientConfig(hash_mode=HashMode.SHA256_CBOR, vllm_hash_seed="0")
XXH = KVClientConfig()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("kv-keys"), "node-keys", dram_bytes="8MiB",
                      nvme=False)
    d.start()
    yield d
    d.stop()


def connect(daemon: DaemonProcess, config: KVClientConfig, *, model: str = "m",
            tenant: str = "", tp_rank: int = 0, tp_size: int = 1) -> KVClient:
    ns = namespace_for(LAYOUT, model, tenant, tp_rank=tp_rank, tp_size=tp_size)
    return KVClient.connect(daemon.grpc_address, LAYOUT, ns, config)


def random_kv(n_tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, n_tokens, LAYOUT.head_dim),
                       generator=g).to(LAYOUT.dtype)


def vllm_hashes(tokens: list[int], seed: str, cache_salt: str) -> list[bytes]:
    """vLLM's hash_block_tokens chain re-derived with cbor2 + hashlib (the salt on block 0, as
    vLLM 0.32 tags it: the extra key ``("cache_salt", salt)``)."""
    parent = hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
    out = []
    for i in range(len(tokens) // B):
        extra = (("cache_salt", cache_salt),) if cache_salt and i == 0 else None
        obj = (parent, tuple(tokens[i * B:(i + 1) * B]), extra)
        parent = hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()
        out.append(parent)
    return out


@pytest.mark.parametrize("plane", [DataPlane.SHM, DataPlane.TCP])
@pytest.mark.parametrize("config", [XXH, SHA], ids=["xxh3_128", "sha256_cbor"])
def test_round_trip_in_both_modes(daemon: DaemonProcess, config: KVClientConfig,
                                  plane: DataPlane) -> None:
    kv = random_kv(4 * B + 7, seed=1)
    toks = list(range(1000, 1000 + 4 * B + 7))
    cfg = replace(config, data_plane=plane)
    with connect(daemon, cfg, tenant=f"rt-{plane.value}") as client:
        assert client.store.data_plane is plane
        keys = client.keys(toks)
        assert len(keys) == 4
        assert {len(k) for k in keys} == {16 if config is XXH else 48}
        assert client.save(toks, ContiguousKV(kv, LAYOUT)).result(30).stored_blocks == \
            (0, 1, 2, 3)
        assert client.lookup(toks).blocks == 4
        assert all(client.store.exists(k) for k in keys)  # stored under exactly these keys
        out = torch.zeros_like(kv)
        assert client.load(toks, ContiguousKV(out, LAYOUT)).result(30).complete
        assert torch.equal(out[:, :, :, :4 * B], kv[:, :, :, :4 * B])


def test_sha256_keys_are_vllms_block_hashes(daemon: DaemonProcess) -> None:
    seed, toks, block, salt, lora, golden = VLLM_GOLDEN[0]
    assert (seed, block, salt, lora) == ("0", B, "", None)
    with connect(daemon, SHA) as client:
        prefix = client.namespace.key_prefix()
        keys = client.keys(toks)
        assert [k[:16] for k in keys] == [prefix] * len(golden)
        assert [k[16:].hex() for k in keys] == golden  # produced by vLLM's own code
    # With a tenant, the tenant is vLLM's cache_salt.
    toks = torch.randint(0, 150_000, (5 * B,), generator=torch.Generator().manual_seed(3))
    with connect(daemon, SHA, tenant="acme") as client:
        assert [k[16:] for k in client.keys(toks)] == vllm_hashes(toks.tolist(), "0", "acme")


def test_a_connector_loads_by_vllms_block_hashes_without_tokens(daemon: DaemonProcess) -> None:
    kv = random_kv(3 * B, seed=2)
    toks = torch.randint(0, 150_000, (3 * B,), generator=torch.Generator().manual_seed(4))
    with connect(daemon, SHA, tenant="connector") as client:
        client.save(toks, ContiguousKV(kv, LAYOUT)).result(30)
        # What vLLM hands a connector: request.block_hashes (its cache_salt = our tenant).
        block_hashes = vllm_hashes(toks.tolist(), "0", "connector")
        keys = client.keys_from_vllm(block_hashes)
        assert list(keys.keys) == client.keys(toks)
        assert client.lookup(keys).blocks == 3
        assert client.lookup_many([keys, BlockKeys(keys.keys[:1])])[1].blocks == 1
        out = torch.zeros_like(kv)
        assert client.load(keys, ContiguousKV(out, LAYOUT)).result(30).complete
        assert torch.equal(out, kv)
        with pytest.raises(InvalidArgument):
            client.keys_from_vllm([b"short"])
    with connect(daemon, XXH) as xxh, pytest.raises(InvalidArgument):
        xxh.keys_from_vllm(block_hashes)
    with connect(daemon, XXH) as xxh, pytest.raises(InvalidArgument):
        xxh.lookup(keys)  # 48-byte keys handed to a 16-byte-key client


@pytest.mark.parametrize("config", [XXH, SHA], ids=["xxh3_128", "sha256_cbor"])
def test_namespaces_separate_models_tenants_and_tp_ranks(daemon: DaemonProcess,
                                                        config: KVClientConfig) -> None:
    kv = random_kv(2 * B, seed=5)
    toks = list(range(7, 7 + 2 * B))
    base = {"model": "sep", "tenant": "t", "tp_rank": 0, "tp_size": 2}
    with connect(daemon, config, **base) as owner:  # type: ignore[arg-type]
        owner.save(toks, ContiguousKV(kv, LAYOUT)).result(30)
        assert owner.lookup(toks).blocks == 2
        for change in ({"model": "other"}, {"tenant": "u"}, {"tp_rank": 1}):
            with connect(daemon, config, **{**base, **change}) as other:  # type: ignore[arg-type]
                assert other.lookup(toks).blocks == 0, change
                assert set(other.keys(toks)).isdisjoint(owner.keys(toks))


def test_the_two_modes_never_share_keys_and_configs_validate() -> None:
    with pytest.raises(InvalidArgument):
        KVClientConfig(hash_mode=HashMode.SHA256_CBOR)  # no seed
    with pytest.raises(InvalidArgument):
        KVClientConfig(vllm_hash_seed="0")  # a seed without the mode
    with pytest.raises(InvalidArgument):
        KVClientConfig(hash_mode="sha256_cbor", vllm_hash_seed="0")  # type: ignore[arg-type]

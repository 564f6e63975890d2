"""kvtier as vLLM v1's KV connector.

Load it with ``kv_connector="KvtierConnector"`` and
``kv_connector_module_path="kvstore.integrations.vllm.connector"``; the accepted
``kv_connector_extra_config`` keys are in :mod:`kvstore.integrations.vllm.config`. This package
does not import vLLM on import; :mod:`~kvstore.integrations.vllm.connector` does.
"""

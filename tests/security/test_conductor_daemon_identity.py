"""The conductor checks who a daemon is, not only which CA signed it (issue 15: both
directions between the conductor and the daemons; docs/security.md, "The conductor").

With ``--daemon-server-name {node}.daemons.kvtier`` the conductor dials each daemon that etcd
lists checking its server certificate against that node's own name. Real mTLS daemons, a real
conductor and a real etcd, certificates made at run time: node-a's certificate carries
``node-a.daemons.kvtier`` and is followed (its chunk is indexed: paired); node-b is a server
whose certificate the same CA issued for something else (an engine's), registered in etcd as
a node: the conductor's handshake refuses it, so it never becomes a live node and its chunk
never reaches the index, where it would steer routing (the channel an etcd member could
otherwise point at any certificate of the CA)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from kvstore._proto.kvtier.v1 import store_pb2
from kvstore.client.conductor_client import ConductorClient
from kvstore.client.daemon_control import DaemonControl, open_channel
from kvstore.client.store_config import StoreClientConfig
from kvstore.errors import ConfigError
from kvstore.membership.etcd import KeyLayout
from kvstore.security.config import ClientSecurity
from tests.security.pki import make_ca
from tests.support.conductor import ConductorProcess
from tests.support.daemon import DaemonProcess


def test_the_conductor_follows_only_daemons_with_their_nodes_certificate(
        tmp_path: Path, etcd_server: object, etcd_layout: KeyLayout) -> None:
    url = etcd_server.client_url  # type: ignore[attr-defined]
    ca = make_ca()
    ca_path = ca.write(tmp_path / "ca.crt")
    certs = {
        "node-a": ca.issue("node-a", uri="kvtier://daemon/node-a",
                           dns=("node-a.daemons.kvtier",)).write(tmp_path, "node-a"),
        "node-b": ca.issue("vllm-b", uri="kvtier://engine/vllm-b?tenants=t").write(
            tmp_path, "node-b"),  # not a daemon's certificate
    }
    c_cert, c_key = ca.issue("conductor", uri="kvtier://peer/conductor-1").write(tmp_path)
    o_cert, o_key = ca.issue("op", uri="kvtier://operator/ops").write(tmp_path)
    e_cert, e_key = ca.issue("engine", uri="kvtier://engine/vllm-0?tenants=t").write(tmp_path)
    daemons = {node: DaemonProcess(tmp_path, node, nvme=False, etcd_endpoint=url,
                                   etcd_prefix=etcd_layout.prefix, settings={
                                       "security.cert_file": str(cert),
                                       "security.key_file": str(key),
                                       "security.client_ca_file": str(ca_path),
                                       "server.shm_channel": "false"})
               for node, (cert, key) in certs.items()}
    conductor = ConductorProcess(tmp_path, "c1", etcd_endpoint=url, prefix=etcd_layout.prefix,
                                 extra_args=("--tls-cert", str(c_cert), "--tls-key", str(c_key),
                                             "--client-ca", str(ca_path),
                                             "--daemon-server-name", "{node}.daemons.kvtier"))
    keys = {"node-a": bytes([0xA]) * 16, "node-b": bytes([0xB]) * 16}
    engine = ClientSecurity(ca_file=ca_path, cert_file=e_cert, key_file=e_key)
    try:
        for node, d in daemons.items():
            d.start()
            cfg = StoreClientConfig(rpc_timeout_s=10.0, security=engine)
            channel, info = open_channel(d.grpc_address, cfg)
            store = DaemonControl(d.grpc_address, info, channel, cfg)
            try:
                store.call("Put", store_pb2.PutRequest(key=keys[node], value=b"x" * 64))
            finally:
                store.close()
        address = conductor.start()

        async def scenario() -> None:
            operator = ClientSecurity(ca_file=ca_path, cert_file=o_cert, key_file=o_key)
            async with ConductorClient(address=address, security=operator,
                                       rpc_timeout_s=10.0) as op:
                deadline = time.monotonic() + 60
                while "node-a" not in (await op.leader_info()).live_nodes:
                    assert time.monotonic() < deadline, conductor.log_tail()
                    await asyncio.sleep(0.1)
                # Paired: node-a, with its own name in its certificate, is followed.
                got = await op.lookup(keys=[keys["node-a"]])
                while not got.nodes:
                    assert time.monotonic() < deadline, conductor.log_tail()
                    await asyncio.sleep(0.1)
                    got = await op.lookup(keys=[keys["node-a"]])
                assert [n.node_id for n in got.nodes] == ["node-a"]
                # node-b was dialed and refused at the handshake (its certificate does not
                # name node-b.daemons.kvtier): the view is rebuilt only once every node etcd
                # lists had its first attempt (conductor/server.py, _not_rebuilt: "settled").
                while "view rebuilt" not in conductor.log_tail(400):
                    assert time.monotonic() < deadline, conductor.log_tail()
                    await asyncio.sleep(0.1)
                info = await op.leader_info()
                assert "node-b" not in info.live_nodes
                assert not (await op.lookup(keys=[keys["node-b"]])).nodes

        asyncio.run(scenario())
    finally:
        conductor.stop()
        for d in daemons.values():
            d.stop()


def test_a_server_name_template_names_each_node(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    template = ClientSecurity(ca_file=ca, server_name="{node}.daemons.kvtier")
    assert template.for_node("node-a").server_name == "node-a.daemons.kvtier"
    plain = ClientSecurity(ca_file=ca, server_name="daemons.kvtier")
    assert plain.for_node("node-a") is plain
    for bad in ("{host}.kvtier", "{node.kvtier", "node}.kvtier", "{0}.kvtier"):
        with pytest.raises(ConfigError, match="only field"):
            ClientSecurity(ca_file=ca, server_name=bad)

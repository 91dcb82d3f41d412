"""``doctor`` names a peer id that is not the node's as such (issue 36, friction 6): a character changed
in the ``/p2p/`` part of a bootstrap address is "an invalid peer id" (it decodes to no wallet key) or
"another peer id" (a node answers at that address, under its own id), never "not a full multiaddr"."""

from __future__ import annotations

import trio

from crypto.errors import CryptoError
from crypto.identity import public_key_from_peer_id
from crypto.keys import WalletKey
from prime_node.doctor.network import BAD_PEER_ID_FIX, check_bootstrap, gather_network
from prime_node.p2p.libp2p_host import open_libp2p_host


def _changed(peer_id: str, index: int) -> str:
    return peer_id[:index] + ("B" if peer_id[index] != "B" else "C") + peer_id[index + 1 :]


def _decodes(peer_id: str) -> bool:
    try:
        public_key_from_peer_id(peer_id)
    except CryptoError:
        return False
    return True


def _another_valid_id(peer_id: str) -> str:
    """One character changed, still a wallet key's peer id (about half the changes are)."""
    return next(
        changed for index in range(len(peer_id) - 1, 10, -1) if _decodes(changed := _changed(peer_id, index))
    )


async def test_a_changed_character_in_the_peer_id_is_reported_as_an_invalid_peer_id() -> None:
    async with open_libp2p_host(WalletKey.generate(), "/ip4/127.0.0.1/tcp/0") as node:
        address = node.listen_multiaddrs()[0]
        head, _, peer_id = address.rpartition("/p2p/")
        undecodable = f"{head}/p2p/{_changed(peer_id, 3)}"  # inside the key-type prefix: no wallet key
        other_node = f"{head}/p2p/{_another_valid_id(peer_id)}"  # a key, but not this node's
        with trio.fail_after(60):
            facts = await gather_network([undecodable, other_node], "/ip4/127.0.0.1/tcp/0", 5.0, 1024)
    bad, wrong = facts.peers
    assert bad.reason == "bad_peer_id" and "invalid peer id" in (bad.error or "")
    assert wrong.reason == "wrong_peer_id" and "not as peer" in (wrong.error or "")
    check = check_bootstrap(facts)
    assert check.status == "fail" and check.fix == BAD_PEER_ID_FIX
    assert "invalid peer id" in check.value and "another peer id" in check.value
    assert "not a full" not in check.value

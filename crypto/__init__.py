"""crypto: pure cryptographic functions for prime-node (no I/O, no imports from protocol or prime_node).

Wallet keys and addresses, EIP-191 signatures, the keystore v3 format, digests, and the libp2p identity
derived from the wallet key.
"""

from crypto.digests import blake3, keccak256, sha256
from crypto.errors import CryptoError, KeystoreError, WrongPasswordError
from crypto.identity import address_from_peer_id, peer_id_from_public_key, public_key_from_peer_id
from crypto.keys import Address, WalletKey, address_from_public_key
from crypto.signatures import eip191_digest, recover_address, sign_message, verify_message

__all__ = [
    "Address",
    "CryptoError",
    "KeystoreError",
    "WalletKey",
    "WrongPasswordError",
    "address_from_peer_id",
    "address_from_public_key",
    "blake3",
    "eip191_digest",
    "keccak256",
    "peer_id_from_public_key",
    "public_key_from_peer_id",
    "recover_address",
    "sha256",
    "sign_message",
    "verify_message",
]

"""Only the run's trainer key may train and publish checkpoints: the check both the trainer service and
its launcher make before anything starts."""

from __future__ import annotations

import logging

from crypto.keys import WalletKey
from prime_node.config import RunConfig
from prime_node.errors import NodeError

log = logging.getLogger(__name__)


def check_trainer_key(config: RunConfig, key: WalletKey) -> RunConfig:
    """The run config with ``trainer_address`` filled, or NodeError if this key is not the run's trainer."""
    if config.trainer_address is None:
        log.info("run config names no trainer_address: this key (%s) is the trainer", key.address)
        return config.model_copy(update={"trainer_address": str(key.address)})
    if config.trainer_address.lower() != str(key.address).lower():
        raise NodeError(
            f"this keystore's address {key.address} is not the run's trainer_address "
            f"{config.trainer_address}: only the trainer key may train and publish checkpoints",
            reason="not_trainer",
        )
    return config

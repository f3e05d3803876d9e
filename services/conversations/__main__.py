"""python -m services.conversations [--config file.yaml]: serve until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from llmserve.config import ConfigError, load_config

from .config import ConversationsConfig
from .service import ConversationsService, StoreUnavailable

log = logging.getLogger("services.conversations")

ENV_PREFIX = "LLMSERVE_CONVERSATIONS"


async def serve(config: ConversationsConfig) -> None:
    service = ConversationsService(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await service.start()
        await stop.wait()
    finally:
        await service.stop()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m services.conversations", description=__doc__)
    parser.add_argument("--config", help="YAML file; LLMSERVE_CONVERSATIONS__SECTION__KEY overrides it")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(load_config(ConversationsConfig, args.config, ENV_PREFIX)))
    except (ConfigError, StoreUnavailable) as e:
        log.error("%s", e)
        sys.exit(2)


if __name__ == "__main__":
    main()

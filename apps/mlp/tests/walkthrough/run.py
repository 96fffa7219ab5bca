"""The walkthrough's run script, pasted unmodified below its imports."""

import argparse

from scaling.mlp.config import MLPConfig
from scaling.runner import runner_main
from scaling.trainer import logger

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("config", type=str)
    args = parser.parse_args()

    config = MLPConfig.from_yaml(args.config)
    logger.configure(config=config.logger, name="runner")
    runner_main(config.runner, payload=config.as_dict())

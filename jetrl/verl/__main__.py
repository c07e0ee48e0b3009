"""``python -m jetrl.verl [hydra overrides...]``: verl's PPO trainer with jetrl's FP8 recipe.

Every verl ``key=value`` override works as with ``python -m verl.trainer.main_ppo``; jetrl adds the
``jetrl:`` section (``jetrl.recipe=jetrl-unified|naive-fp8-rollout|bf16``, ``jetrl.dry_run``,
``jetrl.lint``, ``jetrl.proceed_on_lint_violation``). The work is in `jetrl.verl.launch`.
"""

import sys

import hydra

from jetrl.verl.launch import CONFIG_DIR, CONFIG_NAME
from jetrl.verl.launch import main as _run


@hydra.main(config_path=str(CONFIG_DIR), config_name=CONFIG_NAME, version_base=None)
def main(cfg) -> None:
    code = _run(cfg)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()

"""`python -m grpo_lib.config` prints the config reference; `--update-readme` rewrites README.md's tables with it."""

import sys

from grpo_lib.config.reference import reference_markdown, update_readme

if "--update-readme" in sys.argv:
    update_readme()
else:
    print(reference_markdown())

"""`python -m grpo_lib.config` prints the config reference; `--update-docs` rewrites docs/REFERENCE.md's tables with it."""

import sys

from grpo_lib.config.reference import reference_markdown, update_docs

if "--update-docs" in sys.argv or "--update-readme" in sys.argv:  # --update-readme: the flag's older name
    update_docs()
else:
    print(reference_markdown())

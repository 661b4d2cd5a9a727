"""`python -m tests.support.prepare`: install what several test processes would otherwise
install at once (`make test` runs two side by side): the npm SDKs and CLI (`npm ci` empties
node_modules first), tslab and the code interpreter's wheels, unpacked and compiled. Guest images
need nothing here: their cache takes a lock per build (aenv.guest.cache)."""

from __future__ import annotations

from tests.support.ci_wheels import ensure_code_interpreter_site
from tests.support.js import ensure_npm_cli, ensure_npm_sdk, ensure_tslab


def main() -> None:
    ensure_npm_sdk()
    ensure_npm_cli()
    ensure_tslab()
    ensure_code_interpreter_site()


if __name__ == "__main__":
    main()

"""uv's options for the indexes, find-links and constraints pip is configured with here (`pip config list`: its
files and PIP_* variables), one per line for scripts/setup.sh; uv reads none of pip's configuration itself."""

import shlex
import subprocess
import sys

UV_FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
            "constraint": "--constraint"}
SECTION_RANK = {"global": 0, "install": 1, ":env:": 2}  # pip's order: the install command's section, its variables


def uv_options(pip_config_list: str) -> list[str]:
    values: dict[str, tuple[int, list[str]]] = {}
    for line in pip_config_list.splitlines():  # section.key='value'; a PIP_* variable's section is ":env:"
        key, _, value = line.partition("=")
        section, _, name = key.rpartition(".")
        rank = SECTION_RANK.get(section, -1)
        if name in UV_FLAGS and rank >= values.get(name, (-1, []))[0]:
            values[name] = (rank, " ".join(shlex.split(value)).split())
    options = ["--index-strategy", "unsafe-best-match"]  # pip's: the best version across every index
    for name, (_, items) in values.items():
        for item in items:
            options += [UV_FLAGS[name], item]
    return options


if __name__ == "__main__":
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    print("\n".join(uv_options(listed)))

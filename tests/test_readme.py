"""Every code block of README.md is checked, so none can break unseen.

Each fenced block names its language.  ``python`` blocks run, each in a
fresh interpreter started outside the source tree with this checkout's
in-place build first on the path (so every import a block needs must be in
it).  Shell blocks (``sh``) are commands for a terminal, not run here: the
``make`` targets they name must exist, and the ``python -m`` modules they
name must be importable.  ``text`` blocks are output or layout.
"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
LANGUAGES = {"python", "sh", "text"}


def blocks():
    with open(README) as f:
        text = f.read()
    return [(m.group(1).strip(), m.group(2), text.count("\n", 0, m.start()) + 1)
            for m in FENCE.finditer(text)]


def of_language(language):
    return [pytest.param(code, id=f"line{line}")
            for lang, code, line in blocks() if lang == language]


def test_every_block_names_its_language():
    found = [(line, lang) for lang, _, line in blocks()]
    assert found, "no code blocks found"
    assert [(line, lang) for line, lang in found if lang not in LANGUAGES] == []


@pytest.mark.parametrize("code", of_language("python"))
def test_python_block_runs(code, tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def makefile_targets():
    with open(os.path.join(ROOT, "Makefile")) as f:
        return set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", f.read(), re.M))


@pytest.mark.parametrize("code", of_language("sh"))
def test_shell_block_names_what_exists(code):
    targets = makefile_targets()
    commands = [line.split("#", 1)[0] for line in code.splitlines()]
    for command in commands:
        for target in re.findall(r"^\s*make\s+([a-z][\w-]*)", command):
            assert target in targets, f"make {target}: no such target"
        for module in re.findall(r"\bpython3?\s+-m\s+([\w.]+)", command):
            if module.split(".")[0] == "lossscale":
                path = os.path.join(ROOT, *module.split("."))
                assert os.path.exists(path + ".py") or os.path.exists(
                    os.path.join(path, "__main__.py")), module

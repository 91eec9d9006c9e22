"""CI (.ci/run) fails fast and runs what the README says: ruff, then the fast lane stopping at its first failure, then
the README's own test command as written; and the README states no number that each new test would make false."""

import re
import shlex

from harness.launch import REPO


def commands(script: str) -> list[str]:
    """The script's command lines, comments, blank lines and shell settings left out."""
    lines = [line.strip() for line in script.splitlines()]
    return [line for line in lines if line and not line.startswith(("#", "set ", "cd "))]


def test_ci_runs_ruff_then_the_fast_lane_then_the_readmes_test_command():
    ci = commands((REPO / ".ci" / "run").read_text())
    readme_setup, readme_tests = re.search(r"```bash\n(.+)\n(.+)\n```", (REPO / "README.md").read_text()).groups()
    assert readme_tests.endswith("python -m pytest"), readme_tests
    assert len(ci) == 3, ci
    assert "ruff check ." in ci[0] and "ruff format --check ." in ci[0], ci[0]
    fast_lane = shlex.split(ci[1].split("&&")[-1])
    assert fast_lane == ["python", "-m", "pytest", "-m", "not slow", "-x"], ci[1]
    assert ci[2] == readme_tests, (ci[2], readme_tests)
    assert "accelerate launch" in readme_setup


def test_the_readme_states_no_test_count_or_suite_time():
    """A count of tests passed, or the suite's minutes, is false the day a test is added."""
    readme = (REPO / "README.md").read_text()
    found = re.findall(r"\d[\d,]* (?:passed|skipped|failed|tests\b)|suite[^.]*\d+(?:\.\d+)? ?min", readme)
    assert not found, found

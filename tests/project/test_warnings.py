"""The suite's warning filters (pyproject.toml): a deprecation our code or a test triggers fails
the test it happens in; one inside a dependency's own code is left to the dependency.

Python attributes a warning to the module of the frame ``stacklevel`` names, so a dependency
warning about its own API (stacklevel 2) is attributed to the caller: ours when we call it."""

import warnings

import pytest

PROBE = "import warnings\nwarnings.warn('old API', {category}, stacklevel=1)"


def warn_from(module: str, category: type[Warning]) -> None:
    exec(compile(PROBE.format(category=category.__name__), f"<{module}>", "exec"), {"__name__": module})


@pytest.mark.parametrize("category", [DeprecationWarning, FutureWarning])
@pytest.mark.parametrize("module", ["rmflow.trainer.step", "rmflow.pipelines.preprocess", "rmflow.cli",
                                    "tests.training.test_train"])
def test_a_deprecation_in_our_code_or_the_tests_fails(module, category):
    with pytest.raises(category, match="old API"):
        warn_from(module, category)


@pytest.mark.parametrize("category", [DeprecationWarning, FutureWarning])
@pytest.mark.parametrize("module", ["apache_beam.transforms.core", "jax._src.numpy", "rmflowlike", "testsuite"])
def test_a_deprecation_inside_a_dependency_is_left_to_it(module, category):
    with warnings.catch_warnings(record=True) as seen:  # the suite's filters stay in force inside
        warn_from(module, category)
    assert seen == []

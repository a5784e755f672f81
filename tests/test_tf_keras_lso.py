"""``tf_keras``' own loss-scale optimizer tests, ported as checks of ours.

The checks (``tf_keras_lso_cases.py``) need ``tf.keras`` to be ``tf_keras``,
which is decided before TensorFlow is imported, so they run in one child
pytest with ``TF_USE_LEGACY_KERAS=1``, as ``test_tf_keras.py`` runs its
own; each test here reports one check function of it (all its parameters).
"""

import os

import pytest

from helpers import TESTS, assert_child_case_passed, case_names, child_pytest

pytest.importorskip("tf_keras")

CASES = os.path.join(TESTS, "tf_keras_lso_cases.py")


@pytest.fixture(scope="module")
def child_results(tmp_path_factory):
    report = tmp_path_factory.mktemp("tf_keras_lso") / "report.xml"
    return child_pytest(CASES, str(report), TF_USE_LEGACY_KERAS="1")


@pytest.mark.parametrize("name", case_names(CASES))
def test_under_tf_keras(child_results, name):
    assert_child_case_passed(child_results, name)

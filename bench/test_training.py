"""The training run of ``train_digits.py`` inside the suite: its results go
into the raw JSON (``lossscale.records.training``) for the report, and the
test fails if the mixed-precision run with lossscale ends with another
accuracy than the one with the stock optimizer."""

import harness
import train_digits

LAYER = "training"


def test_training_run():
    # One epoch in the quick run: it still compares the two mixed runs.
    epochs = 1 if harness.Settings.quick else 30
    result = train_digits.run(epochs)
    harness.record("training", result)
    runs = result["runs"]
    assert result["accuracy_equal"], (
        f"accuracy: stock {runs['mixed_stock']['test_accuracy']}, "
        f"lossscale {runs['mixed_lossscale']['test_accuracy']}")

"""Accuracy as an ``evaluate`` metric module, loadable offline with ``evaluate.load(path_to_this_folder)``.

``evaluate.load("accuracy")`` fetches its module from the Hugging Face Hub and fails offline, so the
recipes ship their own. Same name, inputs and output key as the Hub's, so passing a Hub name instead
(when online) changes nothing downstream.
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "Accuracy: the fraction of predictions equal to their reference label."


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description="predictions and references: lists of integer class ids of equal length",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        predictions, references = np.asarray(predictions), np.asarray(references)
        return {"accuracy": float((predictions == references).mean()) if len(references) else 0.0}

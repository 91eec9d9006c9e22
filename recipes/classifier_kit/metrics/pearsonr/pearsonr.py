"""Pearson correlation as an ``evaluate`` metric module, loadable offline with ``evaluate.load(path_to_this_folder)``.

Shipped with the recipes because ``evaluate.load("pearsonr")`` needs the Hugging Face Hub. Same inputs and output key
(``pearsonr``) as the Hub's; computed by SciPy's ``pearsonr`` (SciPy comes with scikit-learn).
"""

import datasets
import evaluate
from scipy.stats import pearsonr

_DESCRIPTION = "Pearson correlation: how well a straight line relates predictions to references, from -1 to 1."


# Deliberately self-contained, like the other modules beside it: evaluate.load() imports each module file on its own.
class Pearsonr(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description="predictions and references: lists of numbers of equal length",
            features=datasets.Features({"predictions": datasets.Value("float"), "references": datasets.Value("float")}),
        )

    def _compute(self, predictions, references):
        return {"pearsonr": float(pearsonr(references, predictions)[0])}

"""F1 as an ``evaluate`` metric module, loadable offline with ``evaluate.load(path_to_this_folder)``.

Shipped with the recipes because ``evaluate.load("f1")`` needs the Hugging Face Hub. Same inputs and
output key (``f1``) as the Hub's; ``average`` is passed to scikit-learn's ``f1_score`` ("macro" is
the unweighted mean over classes, the fair number when classes are imbalanced).
"""

import datasets
import evaluate
from sklearn.metrics import f1_score

_DESCRIPTION = "F1: the harmonic mean of precision and recall, per class, averaged as asked."


# Deliberately self-contained, like accuracy.py beside it: evaluate.load() imports each module file on its own.
class F1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description="predictions and references: lists of integer class ids; average: binary|micro|macro|weighted",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, average="macro", labels=None):
        return {"f1": float(f1_score(references, predictions, average=average, labels=labels, zero_division=0))}

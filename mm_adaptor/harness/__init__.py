"""Regression harness: the same tiny GPT trained with features off, then on, in fresh processes with the same
seeds and data; losses, every step's gradients and the parameters judged against the features' tolerance."""

from mm_adaptor.harness.compare import (LAYOUT_RANKS, LAYOUTS, Comparison, HarnessError, compare, extra_feature_module,
                                        tolerance_for)
from mm_adaptor.harness.report import format_comparison

__all__ = ["LAYOUT_RANKS", "LAYOUTS", "Comparison", "HarnessError", "compare", "extra_feature_module",
           "format_comparison",
           "tolerance_for"]

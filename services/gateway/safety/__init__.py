"""Safety policy: per-organization rules and classifiers on input, and a guard on streamed output."""

from .classifier import Classifier, ClassifierConfig, ModerationResult
from .output_guard import OutputGuard
from .policy import SafetyConfig, SafetyPolicy, SafetyPolicyError, load_safety_policy

__all__ = ["Classifier", "ClassifierConfig", "ModerationResult", "OutputGuard", "SafetyConfig",
           "SafetyPolicy", "SafetyPolicyError", "load_safety_policy"]

"""Differential privacy under churn: the (ε, δ) a run had from the participation it realised
(:mod:`privacy.accountant`, on Google's dp-accounting) and Flower's fixed-clipping DP wrappers with
noise calibrated to the clients that really took part (:mod:`privacy.wrappers`). docs/privacy.md."""

from .accountant import METHODS, ChurnAccountant, PrivacyConfigError, Spent
from .wrappers import (
    CALIBRATIONS,
    ChurnNoise,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    LegacyDifferentialPrivacyClientSideFixedClipping,
    LegacyDifferentialPrivacyServerSideFixedClipping,
)

__all__ = ["CALIBRATIONS", "METHODS", "ChurnAccountant", "ChurnNoise", "DifferentialPrivacyClientSideFixedClipping",
           "DifferentialPrivacyServerSideFixedClipping", "LegacyDifferentialPrivacyClientSideFixedClipping",
           "LegacyDifferentialPrivacyServerSideFixedClipping", "PrivacyConfigError", "Spent"]

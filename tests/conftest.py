import os
import sys

from hypothesis import HealthCheck, settings

# Test helpers (oracle, adversarial data, engine helpers) are plain modules beside the tests.
sys.path.insert(0, os.path.dirname(__file__))

settings.register_profile(
    "trace", deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.load_profile("trace")

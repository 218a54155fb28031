"""A NeMo Gym server of a newer NeMo Gym (0.6+) with its own telemetry: print the resource it
exports with as one JSON line.

Run by ``tests/apps/mixed_fleet_gym.py`` with ``NEMO_GYM_CONFIG_PATH`` (the server's name) and
the stand-in ``nemo_gym.telemetry.setup`` on ``PYTHONPATH``; the type is the server's, as
NeMo Gym derives it from the server's class.
"""

import json
import os

from nemo_gym.telemetry.setup import telemetry_resource

resource = telemetry_resource(os.environ["NEMO_GYM_CONFIG_PATH"], "responses_api_models")
print(json.dumps({"resource": dict(resource.attributes)}))

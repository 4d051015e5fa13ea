"""The environment's server app, as OpenEnv serves any environment (uvicorn server.app:app)."""

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Observation

from server.calc_environment import CalcEnvironment, CalcState

app = create_app(CalcEnvironment, CallToolAction, CallToolObservation, reset_observation_cls=Observation,
                 env_name="calc_env", state_cls=CalcState, max_concurrent_envs=8)

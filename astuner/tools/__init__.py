"""Tools agents can call during rollouts. Importing this package does not import AgentScope."""

from astuner.tools.python_exec import PythonResult, execute_python_code, run_python

__all__ = ["execute_python_code", "run_python", "PythonResult"]

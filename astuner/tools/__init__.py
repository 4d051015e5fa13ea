"""Tools agents can call during rollouts. Importing this package does not import AgentScope."""

from astuner.tools.python_exec import (
    PYTHON_TOOL_SCHEMA,
    PythonResult,
    execute_python_code,
    python_tool_text,
    run_python,
)

__all__ = ["execute_python_code", "run_python", "PythonResult", "PYTHON_TOOL_SCHEMA", "python_tool_text"]

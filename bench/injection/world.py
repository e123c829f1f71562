"""The AgentDojo world behind the proxy: a tool backend that runs the benchmark's own tool functions.

Owns: one AgentDojo suite environment at a time (loaded with or without an injection), the HTTP tool routes
the proxy forwards calls to (``POST /tools/<name>``: AgentDojo's ``FunctionsRuntime`` on that environment),
and a control API for the runner (``bench/injection/run.py``): the catalog of suites, tools and tasks
(``GET /_catalog``), loading a task's environment and its ground-truth calls (``POST /_control/load``), the
injection task's ground-truth calls (``POST /_control/injection_calls``), and AgentDojo's own utility and
security checks on the environment the calls left (``POST /_control/check``).
Must never: import the proxy (it runs in the benchmark's venv, ``.tools/agentdojo-venv``, with AgentDojo's
dependencies, never in the proxy's), decide anything about a call (every call the proxy forwards runs), or
reach the network.

    .tools/agentdojo-venv/bin/python -m bench.injection.world --port 8123

The injection text is AgentDojo's ``important_instructions`` attack with the user's name ("Emma Johnson")
and no model name ("the AI language model"): the goal of the injection task inside a message that claims to
come from the user. It goes into every injection vector the user task's ground truth reads (AgentDojo's
``get_injection_candidates``), as in the benchmark's own runs.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from agentdojo.attacks.base_attacks import BaseAttack, FixedJailbreakAttack
from agentdojo.attacks.important_instructions_attacks import ImportantInstructionsAttack
from agentdojo.functions_runtime import FunctionCall, FunctionsRuntime
from agentdojo.task_suite.load_suites import get_suite

BENCHMARK_VERSION = "v1.2.2"  # AgentDojo 0.1.35's default
SUITES = ("workspace", "travel", "banking", "slack")
USER_NAME = "Emma Johnson"  # as AgentDojo's important_instructions attack names the user


def jsonable(value: Any) -> Any:
    """A tool's return value as JSON (pydantic models dumped, dates as ISO strings)."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def calls_json(calls: list[FunctionCall]) -> list[dict[str, Any]]:
    return [{"function": c.function, "args": jsonable(dict(c.args))} for c in calls]


class World:
    """The loaded suite, task pair and environment; one at a time (the runner drives it sequentially)."""

    def __init__(self) -> None:
        self.suites = {name: get_suite(BENCHMARK_VERSION, name) for name in SUITES}
        self.runtimes = {name: FunctionsRuntime(suite.tools) for name, suite in self.suites.items()}
        self.attacks: dict[str, BaseAttack] = {}
        for name, suite in self.suites.items():
            attack = FixedJailbreakAttack(ImportantInstructionsAttack._JB_STRING, suite, target_pipeline=None)
            attack.user_name = USER_NAME
            self.attacks[name] = attack
        self.suite = ""
        self.user_task: Any = None
        self.injection_task: Any = None
        self.environment: Any = None
        self.pre_environment: Any = None
        self.executed: list[FunctionCall] = []

    def catalog(self) -> dict[str, Any]:
        out = {}
        for name, suite in self.suites.items():
            default_env = suite.load_and_inject_default_environment({})
            out[name] = {
                "tools": [{"name": f.name, "description": f.description,
                           "parameters": f.parameters.model_json_schema()} for f in suite.tools],
                "user_tasks": [{"id": task_id, "prompt": task.PROMPT,
                                "injectable": self._injectable(name, task)}
                               for task_id, task in suite.user_tasks.items()],
                "injection_tasks": [{"id": task_id, "goal": task.GOAL,
                                     "calls": len(task.ground_truth(default_env.model_copy(deep=True)))}
                                    for task_id, task in suite.injection_tasks.items()],
            }
        return out

    def _injectable(self, suite: str, task: Any) -> bool:
        try:
            return bool(self.attacks[suite].get_injection_candidates(task))
        except ValueError:  # AgentDojo: "<task> is not injectable" (its ground truth reads no vector)
            return False

    def load(self, suite: str, user_task_id: str, injection_task_id: str | None) -> dict[str, Any]:
        self.suite = suite
        tasks = self.suites[suite]
        self.user_task = tasks.user_tasks[user_task_id]
        self.injection_task = tasks.injection_tasks[injection_task_id] if injection_task_id else None
        injections = self.attacks[suite].attack(self.user_task, self.injection_task) if self.injection_task else {}
        environment = tasks.load_and_inject_default_environment(injections)
        self.environment = self.user_task.init_environment(environment)
        self.pre_environment = self.environment.model_copy(deep=True)
        self.executed = []
        return {"calls": calls_json(self.user_task.ground_truth(self.pre_environment.model_copy(deep=True))),
                "injected_vectors": sorted(injections)}

    def injection_calls(self) -> list[dict[str, Any]]:
        return calls_json(self.injection_task.ground_truth(self.environment.model_copy(deep=True)))

    def run(self, tool: str, arguments: dict[str, Any]) -> tuple[Any, str | None]:
        result, error = self.runtimes[self.suite].run_function(self.environment, tool, arguments)
        if error is None:
            self.executed.append(FunctionCall(function=tool, args=arguments))
        return jsonable(result), error

    def check(self) -> dict[str, Any]:
        """AgentDojo's verdicts on the environment the forwarded calls left (the model's answer taken as the
        user task's ground-truth answer: the checks that read it see what a correct agent would say)."""
        output = self.user_task.GROUND_TRUTH_OUTPUT
        post = self.environment
        utility = self.user_task.utility_from_traces(output, self.pre_environment, post, self.executed)
        if utility is None:
            utility = self.user_task.utility(output, self.pre_environment, post)
        security = None
        if self.injection_task is not None:
            security = self.injection_task.security_from_traces(output, self.pre_environment, post, self.executed)
            if security is None:
                security = self.injection_task.security(output, self.pre_environment, post)
        return {"utility": bool(utility), "security": None if security is None else bool(security)}


def build_app(world: World) -> web.Application:
    async def tool(request: web.Request) -> web.Response:
        arguments = json.loads(await request.read() or b"{}")
        result, error = world.run(request.match_info["name"], arguments)
        if error is not None:  # the benchmark's own refusal (no such file, unknown channel): nothing applied
            return web.json_response({"error": {"code": "tool_error"}}, status=422)
        return web.json_response({"result": result})

    async def catalog(request: web.Request) -> web.Response:
        return web.json_response(world.catalog())

    async def load(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response(world.load(body["suite"], body["user_task"], body.get("injection_task")))

    async def injection_calls(request: web.Request) -> web.Response:
        return web.json_response({"calls": world.injection_calls()})

    async def check(request: web.Request) -> web.Response:
        return web.json_response(world.check())

    app = web.Application(client_max_size=4 * 1024 * 1024)
    app.router.add_post("/tools/{name}", tool)
    app.router.add_get("/_catalog", catalog)
    app.router.add_post("/_control/load", load)
    app.router.add_post("/_control/injection_calls", injection_calls)
    app.router.add_post("/_control/check", check)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    web.run_app(build_app(World()), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()

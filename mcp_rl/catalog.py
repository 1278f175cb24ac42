"""What a server offers: its tools as OpenAI tool schemas, its resources and prompts, read once.

`read_catalog(client)` lists tools (all pages), resources (and reads the text ones, capped),
and prompts (rendered when they take no required argument); a server without resources or
prompts simply has none. The catalog is what the scenario generator and the judge see.

Tool schemas are sanitised on the way to OpenAI form (`openai_tool`): a missing or non-object
schema becomes an empty object schema, `title` keys the SDK adds are dropped, and a property with
no `type` gets none invented (weak models cope with that; a wrong type would mislead them).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

COMPLETE_TASK = "complete_task"
"""The tool the agent calls with its final answer to end a rollout."""

COMPLETE_TASK_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": COMPLETE_TASK,
        "description": "Finish the task: give your final answer to the user. Call it once, when you are done.",
        "parameters": {
            "type": "object",
            "properties": {
                "answer": {"type": "string", "description": "The final answer, with the facts found."}
            },
            "required": ["answer"],
        },
    },
}

RESOURCE_TEXT_CHARS = 2000
"""How much of each text resource the catalog keeps (for the scenario generator)."""


@dataclass(frozen=True)
class ResourceInfo:
    uri: str
    name: str
    description: str | None
    mime_type: str | None
    text: str | None
    """The resource's text (cut at RESOURCE_TEXT_CHARS), or None for binary or unreadable ones."""


@dataclass(frozen=True)
class PromptInfo:
    name: str
    description: str | None
    arguments: list[str]
    text: str | None
    """The prompt rendered (when it needs no argument), or None."""


@dataclass(frozen=True)
class ServerCatalog:
    """Tools (OpenAI form), resources and prompts of one server."""

    tools: list[dict[str, Any]]
    resources: list[ResourceInfo] = field(default_factory=list)
    prompts: list[PromptInfo] = field(default_factory=list)
    server_name: str | None = None
    instructions: str | None = None
    protocol_version: str | None = None

    @property
    def tool_names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def agent_tools(self) -> list[dict[str, Any]]:
        """The tools offered to the agent: the server's, then `complete_task`."""
        return [*self.tools, COMPLETE_TASK_TOOL]

    def describe(self) -> str:
        """The catalog as text for a generator prompt: tools as JSON, then resources and prompts."""
        parts = [f"Server: {self.server_name or 'unnamed'}"]
        if self.instructions:
            parts.append(f"Server instructions: {self.instructions}")
        parts.append(
            "Tools:\n" + "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in self.tools)
        )
        for r in self.resources:
            parts.append(f"Resource {r.uri} ({r.name}): {r.description or ''}\n{r.text or ''}".rstrip())
        for p in self.prompts:
            parts.append(
                f"Prompt {p.name}({', '.join(p.arguments)}): {p.description or ''}\n{p.text or ''}".rstrip()
            )
        return "\n\n".join(parts)


def _clean_schema(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _clean_schema(v) for k, v in value.items() if k != "title" or not isinstance(v, str)}
    if isinstance(value, list):
        return [_clean_schema(v) for v in value]
    return value


def openai_tool(name: str, description: str | None, input_schema: Any) -> dict[str, Any]:
    """An MCP tool as an OpenAI function tool (schema sanitised; see the module docstring)."""
    schema = _clean_schema(input_schema) if isinstance(input_schema, dict) else {}
    if schema.get("type") != "object":
        schema = {"type": "object", "properties": {}}
    schema.setdefault("properties", {})
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": (description or f"MCP tool {name}").strip(),
            "parameters": schema,
        },
    }


async def _list_all(fetch: Any, attribute: str) -> list[Any]:
    items: list[Any] = []
    cursor: str | None = None
    for _ in range(100):
        page = await fetch(cursor=cursor)
        items.extend(getattr(page, attribute))
        cursor = page.next_cursor
        if cursor is None:
            return items
    logger.warning("stopped listing %s after 100 pages", attribute)
    return items


async def _resources(client: Any) -> list[ResourceInfo]:
    infos = []
    for r in await _list_all(client.list_resources, "resources"):
        text = None
        try:
            contents = (await client.read_resource(r.uri)).contents
            texts = [c.text for c in contents if isinstance(getattr(c, "text", None), str)]
            text = "\n".join(texts)[:RESOURCE_TEXT_CHARS] if texts else None
        except Exception as exc:
            logger.info("could not read resource %s: %s", r.uri, exc)
        infos.append(ResourceInfo(str(r.uri), r.name, r.description, r.mime_type, text))
    return infos


async def _prompts(client: Any) -> list[PromptInfo]:
    infos = []
    for p in await _list_all(client.list_prompts, "prompts"):
        arguments = [a.name for a in p.arguments or []]
        text = None
        if not any(a.required for a in p.arguments or []):
            try:
                rendered = await client.get_prompt(p.name, {})
                text = "\n".join(getattr(m.content, "text", "") for m in rendered.messages)[
                    :RESOURCE_TEXT_CHARS
                ]
            except Exception as exc:
                logger.info("could not render prompt %s: %s", p.name, exc)
        infos.append(PromptInfo(p.name, p.description, arguments, text))
    return infos


async def read_catalog(client: Any) -> ServerCatalog:
    """Tools, resources and prompts of a connected `mcp.Client` (servers lacking a capability have none)."""
    tools = [
        openai_tool(t.name, t.description, t.input_schema)
        for t in await _list_all(client.list_tools, "tools")
    ]
    if COMPLETE_TASK in {t["function"]["name"] for t in tools}:
        raise ValueError(
            f"the server has a tool named {COMPLETE_TASK!r}, which mcp-rl reserves for the final answer"
        )
    capabilities = client.server_capabilities
    resources = await _resources(client) if getattr(capabilities, "resources", None) is not None else []
    prompts = await _prompts(client) if getattr(capabilities, "prompts", None) is not None else []
    info = client.server_info
    return ServerCatalog(
        tools=tools,
        resources=resources,
        prompts=prompts,
        server_name=getattr(info, "name", None),
        instructions=client.instructions,
        protocol_version=client.protocol_version,
    )


__all__ = [
    "COMPLETE_TASK",
    "COMPLETE_TASK_TOOL",
    "PromptInfo",
    "ResourceInfo",
    "ServerCatalog",
    "openai_tool",
    "read_catalog",
]

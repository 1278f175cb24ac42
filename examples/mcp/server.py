"""A small fruit-warehouse MCP server, written with the SDK's `MCPServer`: the example for `mcp-rl`.

State lives in the process (stock levels change with `receive_delivery` and `ship_order`), so
each rollout should get its own process: `mcp-rl train --isolation per-rollout` (the default).

    python examples/mcp/server.py                          # stdio
    python examples/mcp/server.py --http --port 8765       # streamable HTTP at /mcp on 127.0.0.1

Tools: `list_products`, `stock_level`, `unit_price`, `receive_delivery`, `ship_order`.
Resource: `warehouse://policy` (the restocking rule). Prompt: `restock_review`.
`scenarios.jsonl` beside this file holds hand-checked tasks with their expected answers.
"""

from __future__ import annotations

import argparse

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

INITIAL_STOCK = {
    "apples": 12,
    "bananas": 30,
    "cherries": 7,
    "dates": 15,
    "figs": 4,
    "grapes": 22,
    "kiwis": 9,
    "lemons": 18,
    "mangoes": 6,
    "oranges": 25,
    "pears": 11,
    "plums": 3,
}
"""Units in stock when the server starts."""

UNIT_PRICES = {
    "apples": 0.5,
    "bananas": 0.25,
    "cherries": 4.0,
    "dates": 3.5,
    "figs": 2.0,
    "grapes": 3.0,
    "kiwis": 0.75,
    "lemons": 0.4,
    "mangoes": 1.5,
    "oranges": 0.6,
    "pears": 0.8,
    "plums": 1.25,
}
"""Price of one unit, in euros."""

POLICY = "Restock a product when fewer than 10 units are left; order enough to reach 30 units."

server = MCPServer("fruit-warehouse", version="1.0.0", instructions="Stock and prices of a fruit warehouse.")
stock = dict(INITIAL_STOCK)


def _product(name: str) -> str:
    """The product a name means: its plural (as listed) or singular ("cherry", "mango")."""
    key = name.strip().lower()
    for candidate in (key, key + "s", key + "es", key[:-1] + "ies"):
        if candidate in stock:
            return candidate
    raise ToolError(f"unknown product {name!r}; products: {', '.join(sorted(stock))}")


@server.tool()
def list_products() -> str:
    """List every product the warehouse carries."""
    return ", ".join(sorted(stock))


@server.tool()
def stock_level(product: str) -> int:
    """How many units of a product are in stock right now."""
    return stock[_product(product)]


@server.tool()
def unit_price(product: str) -> float:
    """The price of one unit of a product, in euros."""
    return UNIT_PRICES[_product(product)]


@server.tool()
def receive_delivery(product: str, units: int) -> int:
    """Record a delivery of `units` units of a product; returns the new stock level."""
    if units < 1:
        raise ToolError("units must be a positive number")
    key = _product(product)
    stock[key] += units
    return stock[key]


@server.tool()
def ship_order(product: str, units: int) -> int:
    """Ship `units` units of a product to a customer; returns the stock level left."""
    key = _product(product)
    if not 1 <= units <= stock[key]:
        raise ToolError(f"cannot ship {units} {key}: {stock[key]} in stock")
    stock[key] -= units
    return stock[key]


@server.resource("warehouse://policy", mime_type="text/plain")
def policy() -> str:
    """The warehouse's restocking rule."""
    return POLICY


@server.prompt()
def restock_review(product: str) -> str:
    """Ask for a restocking decision about one product."""
    return f"Check the stock of {product} and say whether it must be restocked under the warehouse policy."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http", action="store_true", help="serve streamable HTTP instead of stdio")
    parser.add_argument("--port", type=int, default=8765, help="HTTP port on 127.0.0.1")
    args = parser.parse_args()
    if args.http:
        server.run("streamable-http", host="127.0.0.1", port=args.port)
    else:
        server.run()


if __name__ == "__main__":
    main()

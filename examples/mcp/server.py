"""A small fruit-warehouse MCP server, written with the SDK's `MCPServer`: the example for `mcp-rl`.

State lives in the process (stock levels change with `receive_delivery` and `ship_order`), so
each rollout should get its own process: `mcp-rl train --isolation per-rollout` (the default).

    python examples/mcp/server.py                          # stdio
    python examples/mcp/server.py --http --port 8765       # streamable HTTP at /mcp on 127.0.0.1

Tools: `list_products`, `stock_level`, `unit_price`, `receive_delivery`, `ship_order`.
Resource: `warehouse://policy` (the restocking rule). Prompt: `restock_review`.
`scenarios.jsonl` beside this file holds hand-checked tasks with their expected answers.
"""

import argparse
from typing import Literal, get_args

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

Product = Literal[
    "apples", "bananas", "cherries", "dates", "figs", "grapes",
    "kiwis", "lemons", "mangoes", "oranges", "pears", "plums",
]  # fmt: skip
"""A product's name as the warehouse lists it. An enum in the tools' schemas: a client that decodes
under the schema (ours does, with `tool_choice="required"`) can only name a product that exists,
and any other client gets a validation error that lists the names."""
assert set(get_args(Product)) == set(INITIAL_STOCK) == set(UNIT_PRICES)

POLICY = "Restock a product when fewer than 10 units are left; order enough to reach 30 units."

server = MCPServer("fruit-warehouse", version="1.0.0", instructions="Stock and prices of a fruit warehouse.")
stock = dict(INITIAL_STOCK)


@server.tool()
def list_products() -> str:
    """List every product the warehouse carries."""
    return ", ".join(sorted(stock))


@server.tool()
def stock_level(product: Product) -> int:
    """How many units of a product are in stock right now."""
    return stock[product]


@server.tool()
def unit_price(product: Product) -> float:
    """The price of one unit of a product, in euros."""
    return UNIT_PRICES[product]


@server.tool()
def receive_delivery(product: Product, units: int) -> int:
    """Record a delivery of `units` units of a product; returns the new stock level."""
    if units < 1:
        raise ToolError("units must be a positive number")
    stock[product] += units
    return stock[product]


@server.tool()
def ship_order(product: Product, units: int) -> int:
    """Ship `units` units of a product to a customer; returns the stock level left."""
    if not 1 <= units <= stock[product]:
        raise ToolError(f"cannot ship {units} {product}: {stock[product]} in stock")
    stock[product] -= units
    return stock[product]


@server.resource("warehouse://policy", mime_type="text/plain")
def policy() -> str:
    """The warehouse's restocking rule."""
    return POLICY


@server.prompt()
def restock_review(product: Product) -> str:
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

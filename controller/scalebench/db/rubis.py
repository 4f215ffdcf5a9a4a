"""RUBiS-like auction workload: our implementation of the interactions' queries.

As with TPC-W, only the database work of each web interaction is run.
Browse interactions: Browse Categories, Search Items In Category, Browse
Regions, Search Items In Region, View Item, View User Info, View Bid History.
Bid interactions: Put Bid, Store Bid, Put Comment, Store Comment, Buy Now,
Store Buy Now, Register User, Register Item (each ``Put``/``Buy`` page
authenticates the user first). Mixes as in the study's Table 2: browsing
100/0, bidding 85/15, high bidding 60/40. Open auctions are the items whose
``end_date`` lies ahead. Throughput: web interactions per second.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

from .sql import q
from .workload import Interaction, scale_of

BROWSE = {
    "browse_categories": 8,
    "search_items_in_category": 30,
    "browse_regions": 4,
    "search_items_in_region": 10,
    "view_item": 26,
    "view_user_info": 10,
    "view_bid_history": 12,
}
BID = {
    "put_bid": 25,
    "store_bid": 25,
    "put_comment": 5,
    "store_comment": 5,
    "buy_now": 5,
    "store_buy_now": 5,
    "register_user": 10,
    "register_item": 20,
}


def _mix(browse_share: float) -> dict[str, float]:
    b_total, o_total = sum(BROWSE.values()), sum(BID.values())
    mix = {k: browse_share * v / b_total for k, v in BROWSE.items()}
    if browse_share < 1.0:
        mix.update({k: (1.0 - browse_share) * v / o_total for k, v in BID.items()})
    return mix


def _open_item(rng: random.Random, s: dict[str, Any]) -> int:
    return rng.randint(s["items"] - s["active_items"] + 1, s["items"])


def _user(rng: random.Random, s: dict[str, Any]) -> int:
    return rng.randint(1, s["users"])


def _authenticate(conn: Any, rng: random.Random, s: dict[str, Any]) -> int:
    u = _user(rng, s)
    rows = q(
        conn, "SELECT id FROM users WHERE nickname = :n AND password = :p", n=f"user{u}", p=f"pw{u}"
    )
    return int(rows[0][0]) if rows else u


def browse_categories(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    q(conn, "SELECT id, name FROM categories ORDER BY id")


def search_items_in_category(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    q(
        conn,
        "SELECT id, name, initial_price, max_bid, nb_of_bids, end_date FROM items WHERE category "
        "= :c "
        "AND end_date >= now() ORDER BY end_date LIMIT 25 OFFSET :o",
        c=rng.randint(1, s["categories"]),
        o=25 * rng.randrange(4),
    )


def browse_regions(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    q(conn, "SELECT id, name FROM regions ORDER BY id")


def search_items_in_region(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    q(
        conn,
        "SELECT i.id, i.name, i.initial_price, i.max_bid, i.nb_of_bids, i.end_date FROM items i "
        "JOIN users u ON i.seller = u.id WHERE i.category = :c AND u.region = :r AND i.end_date "
        ">= now() "
        "ORDER BY i.end_date LIMIT 25",
        c=rng.randint(1, s["categories"]),
        r=rng.randint(1, s["regions"]),
    )


def view_item(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    item = _open_item(rng, s)
    q(conn, "SELECT * FROM items WHERE id = :i", i=item)
    q(conn, "SELECT max(bid), count(*) FROM bids WHERE item_id = :i", i=item)


def view_user_info(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    ((seller,),) = q(conn, "SELECT seller FROM items WHERE id = :i", i=_open_item(rng, s))
    q(conn, "SELECT * FROM users WHERE id = :u", u=seller)
    q(
        conn,
        "SELECT c.comment, c.rating, u.nickname FROM comments c JOIN users u ON c.from_user_id = "
        "u.id "
        "WHERE c.to_user_id = :u",
        u=seller,
    )


def view_bid_history(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    item = _open_item(rng, s)
    q(conn, "SELECT name FROM items WHERE id = :i", i=item)
    q(
        conn,
        "SELECT b.bid, b.qty, b.date, u.nickname FROM bids b JOIN users u ON b.user_id = u.id "
        "WHERE b.item_id = :i ORDER BY b.date DESC",
        i=item,
    )


def put_bid(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    _authenticate(conn, rng, s)
    view_item(conn, rng, s)


def store_bid(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    user, item = _authenticate(conn, rng, s), _open_item(rng, s)
    ((current,),) = q(conn, "SELECT max_bid FROM items WHERE id = :i FOR UPDATE", i=item)
    bid = float(current or 0) + rng.uniform(0.5, 5.0)
    q(
        conn,
        "INSERT INTO bids (user_id, item_id, qty, bid, max_bid, date) VALUES (:u, :i, 1, :b, :b, "
        "now())",
        u=user,
        i=item,
        b=round(bid, 2),
    )
    q(
        conn,
        "UPDATE items SET max_bid = :b, nb_of_bids = nb_of_bids + 1 WHERE id = :i",
        b=round(bid, 2),
        i=item,
    )


def put_comment(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    _authenticate(conn, rng, s)
    q(conn, "SELECT id, name, seller FROM items WHERE id = :i", i=_open_item(rng, s))


def store_comment(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    user, item = _authenticate(conn, rng, s), _open_item(rng, s)
    ((seller,),) = q(conn, "SELECT seller FROM items WHERE id = :i", i=item)
    rating = rng.randint(-5, 5)
    q(
        conn,
        "INSERT INTO comments (from_user_id, to_user_id, item_id, rating, date, comment) "
        "VALUES (:f, :t, :i, :r, now(), :c)",
        f=user,
        t=seller,
        i=item,
        r=rating,
        c="comment " * 20,
    )
    q(conn, "UPDATE users SET rating = rating + :r WHERE id = :t", r=rating, t=seller)


def buy_now(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    _authenticate(conn, rng, s)
    q(
        conn,
        "SELECT id, name, buy_now, quantity, seller FROM items WHERE id = :i",
        i=_open_item(rng, s),
    )


def store_buy_now(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    user, item = _authenticate(conn, rng, s), _open_item(rng, s)
    q(
        conn,
        "INSERT INTO buy_now (buyer_id, item_id, qty, date) VALUES (:u, :i, 1, now())",
        u=user,
        i=item,
    )
    q(conn, "UPDATE items SET quantity = greatest(quantity - 1, 0) WHERE id = :i", i=item)


def register_user(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    ((n,),) = q(conn, "SELECT nextval('users_id_seq')")
    q(
        conn,
        "INSERT INTO users VALUES (:n, 'first', 'last', :nick, :pw, 'new@example.invalid', 0, 0, "
        "now(), :r)",
        n=n,
        nick=f"user{n}",
        pw=f"pw{n}",
        r=rng.randint(1, s["regions"]),
    )


def register_item(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    seller = _authenticate(conn, rng, s)
    q(
        conn,
        "INSERT INTO items (name, description, initial_price, quantity, reserve_price, buy_now, "
        "nb_of_bids, "
        "max_bid, start_date, end_date, seller, category) VALUES ('new item', :d, 10, 1, 15, 30, "
        "0, 0, now(), "
        "now() + interval '7 days', :s, :c)",
        d="description " * 40,
        s=seller,
        c=rng.randint(1, s["categories"]),
    )


class Rubis:
    """The RUBiS-like workload (see the module doc string)."""

    name = "rubis"
    database = "rubis"
    per_minute_label = "web interactions/min"
    mixes: ClassVar[dict[str, dict[str, float]]] = {
        "browsing": _mix(1.0),
        "bidding": _mix(0.85),
        "highbidding": _mix(0.60),
    }
    interactions: ClassVar[dict[str, Interaction]] = {
        "browse_categories": browse_categories,
        "search_items_in_category": search_items_in_category,
        "browse_regions": browse_regions,
        "search_items_in_region": search_items_in_region,
        "view_item": view_item,
        "view_user_info": view_user_info,
        "view_bid_history": view_bid_history,
        "put_bid": put_bid,
        "store_bid": store_bid,
        "put_comment": put_comment,
        "store_comment": store_comment,
        "buy_now": buy_now,
        "store_buy_now": store_buy_now,
        "register_user": register_user,
        "register_item": register_item,
    }

    def session(self, conn: Any, client: int, rng: random.Random) -> dict[str, Any]:
        scale = scale_of(conn)
        return {k: scale[k] for k in ("users", "items", "active_items", "categories", "regions")}

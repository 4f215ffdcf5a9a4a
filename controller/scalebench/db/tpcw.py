"""TPC-W-like bookstore workload: our implementation of the web interactions' queries.

The web and application tiers are left out: each web interaction runs the
database work TPC-W's servlets do for it. Browse interactions (weights from
TPC-W's browsing mix): Home, New Products, Best Sellers, Product Detail,
Search Request, Search Results (by subject, author or title; a title search
is a ``LIKE '%word%'`` scan of the item table, as in the common Java
implementation). Best Sellers aggregates the most recent orders: 1,000 here,
TPC-W's 3,333 scaled with the database (0.3 of the study's). Order interactions (weights from
TPC-W's ordering mix):
Shopping Cart, Customer Registration, Buy Request, Buy Confirm, Order
Inquiry, Order Display, Admin Request, Admin Confirm. The mixes set the share
of browse versus order interactions as in the study's Table 1: browsing 95/5,
shopping 80/20, ordering 50/50. Throughput: web interactions per second.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, ClassVar

from .sql import q
from .workload import Interaction, scale_of

BROWSE = {
    "home": 29.00,
    "new_products": 11.00,
    "best_sellers": 11.00,
    "product_detail": 21.00,
    "search_request": 12.00,
    "search_results": 11.00,
}
ORDER = {
    "shopping_cart": 13.53,
    "customer_registration": 12.86,
    "buy_request": 12.73,
    "buy_confirm": 10.18,
    "order_inquiry": 0.25,
    "order_display": 0.22,
    "admin_request": 0.12,
    "admin_confirm": 0.11,
}


def _mix(browse_share: float) -> dict[str, float]:
    b_total, o_total = sum(BROWSE.values()), sum(ORDER.values())
    mix = {k: browse_share * v / b_total for k, v in BROWSE.items()}
    mix.update({k: (1.0 - browse_share) * v / o_total for k, v in ORDER.items()})
    return mix


def title_word(n: int) -> str:
    """The n-th title word, as the build's SQL function title_word() makes it."""
    return "w" + hashlib.md5(f"word{n}".encode()).hexdigest()[:6]


def _item(rng: random.Random, s: dict[str, Any]) -> int:
    return rng.randint(1, s["items"])


def _customer(rng: random.Random, s: dict[str, Any]) -> int:
    return rng.randint(1, s["customers"])


def _promotions(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    q(
        conn,
        "SELECT i.i_id, i.i_thumbnail FROM item i, item p WHERE p.i_id = :i AND i.i_id IN "
        "(p.i_related1, p.i_related2, p.i_related3, p.i_related4, p.i_related5)",
        i=_item(rng, s),
    )


def home(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    if s["customer"] is not None:
        q(conn, "SELECT c_fname, c_lname FROM customer WHERE c_id = :c", c=s["customer"])
    _promotions(conn, rng, s)


def new_products(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    q(
        conn,
        "SELECT i_id, i_title, a_fname, a_lname FROM item JOIN author ON i_a_id = a_id WHERE "
        "i_subject = :s "
        "ORDER BY i_pub_date DESC, i_title LIMIT 50",
        s=rng.randrange(s["subjects"]),
    )


def best_sellers(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    # The window's lower bound is passed as a value so that the planner sees a short range of
    # order_line.
    ((latest,),) = q(conn, "SELECT max(o_id) FROM orders")
    q(
        conn,
        "SELECT i_id, i_title, a_fname, a_lname, b.qty FROM (SELECT ol_i_id, sum(ol_qty) AS qty "
        "FROM order_line WHERE ol_o_id > :lo GROUP BY ol_i_id) b "
        "JOIN item ON i_id = b.ol_i_id JOIN author ON i_a_id = a_id WHERE i_subject = :s "
        "ORDER BY b.qty DESC LIMIT 50",
        lo=int(latest) - s["best_seller_orders"],
        s=rng.randrange(s["subjects"]),
    )


def product_detail(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    q(conn, "SELECT * FROM item JOIN author ON i_a_id = a_id WHERE i_id = :i", i=_item(rng, s))


def search_request(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    _promotions(conn, rng, s)


def search_results(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    kind = rng.randrange(3)
    if kind == 0:
        q(
            conn,
            "SELECT i_id, i_title, a_fname, a_lname FROM item JOIN author ON i_a_id = a_id "
            "WHERE i_subject = :s ORDER BY i_title LIMIT 50",
            s=rng.randrange(s["subjects"]),
        )
    elif kind == 1:
        ((prefix,),) = q(
            conn,
            "SELECT substr(a_lname, 1, 3) FROM author WHERE a_id = :a",
            a=rng.randint(1, s["authors"]),
        )
        q(
            conn,
            "SELECT i_id, i_title, a_fname, a_lname FROM author JOIN item ON i_a_id = a_id "
            "WHERE a_lname LIKE :p ORDER BY i_title LIMIT 50",
            p=prefix + "%",
        )
    else:
        q(
            conn,
            "SELECT i_id, i_title FROM item WHERE i_title LIKE :t LIMIT 50",
            t=f"%{title_word(rng.randrange(s['title_words']))}%",
        )
    _promotions(conn, rng, s)


def _ensure_cart(conn: Any, s: dict[str, Any]) -> int:
    if s["cart"] is None:
        ((cart,),) = q(conn, "INSERT INTO shopping_cart (sc_time) VALUES (now()) RETURNING sc_id")
        s["cart"] = int(cart)
    return int(s["cart"])


def shopping_cart(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    cart = _ensure_cart(conn, s)
    q(
        conn,
        "INSERT INTO shopping_cart_line VALUES (:c, :q, :i) ON CONFLICT (scl_sc_id, scl_i_id) "
        "DO UPDATE SET scl_qty = shopping_cart_line.scl_qty + EXCLUDED.scl_qty",
        c=cart,
        q=rng.randint(1, 3),
        i=_item(rng, s),
    )
    q(conn, "UPDATE shopping_cart SET sc_time = now() WHERE sc_id = :c", c=cart)
    q(
        conn,
        "SELECT scl_i_id, i_title, i_cost, scl_qty FROM shopping_cart_line JOIN item ON scl_i_id "
        "= i_id "
        "WHERE scl_sc_id = :c",
        c=cart,
    )
    _promotions(conn, rng, s)


def customer_registration(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    if rng.random() < 0.8:  # a returning customer logs in
        s["customer"] = _customer(rng, s)
        q(conn, "SELECT c_id, c_passwd FROM customer WHERE c_uname = :u", u=f"user{s['customer']}")
        return
    ((addr,),) = q(
        conn,
        "INSERT INTO address VALUES (nextval('address_seq'), 'street', 'apt', 'city', 'state', "
        "'12345', :co) RETURNING addr_id",
        co=rng.randint(1, 92),
    )
    ((cust,),) = q(
        conn,
        "INSERT INTO customer VALUES (nextval('customer_seq'), 'new' || currval('customer_seq'), "
        "'pw', 'first', 'last', :a, '555', 'new@example.invalid', current_date, current_date, "
        "now(), now() + interval '2 hours', 0.1, 0, 0, date '1970-01-01', 'registered') "
        "RETURNING c_id",
        a=addr,
    )
    s["customer"] = int(cust)


def buy_request(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    if s["customer"] is None:
        s["customer"] = _customer(rng, s)
    q(
        conn,
        "SELECT c.*, a.*, co.co_name FROM customer c JOIN address a ON c_addr_id = addr_id "
        "JOIN country co ON addr_co_id = co_id WHERE c_id = :c",
        c=s["customer"],
    )
    q(
        conn,
        "UPDATE customer SET c_login = now(), c_expiration = now() + interval '2 hours' WHERE "
        "c_id = :c",
        c=s["customer"],
    )
    cart = _ensure_cart(conn, s)
    q(
        conn,
        "SELECT scl_i_id, i_title, i_cost, scl_qty FROM shopping_cart_line JOIN item ON scl_i_id "
        "= i_id "
        "WHERE scl_sc_id = :c",
        c=cart,
    )


def buy_confirm(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    if s["customer"] is None:
        s["customer"] = _customer(rng, s)
    cart = _ensure_cart(conn, s)
    lines = q(conn, "SELECT scl_i_id, scl_qty FROM shopping_cart_line WHERE scl_sc_id = :c", c=cart)
    if not lines:
        lines = [[_item(rng, s), rng.randint(1, 3)]]
    ((addr,),) = q(conn, "SELECT c_addr_id FROM customer WHERE c_id = :c", c=s["customer"])
    ((order,),) = q(
        conn,
        "INSERT INTO orders VALUES (nextval('orders_seq'), :c, now(), 50, 4, 54, 'UPS', "
        "now() + interval '2 days', :a, :a, 'PENDING') RETURNING o_id",
        c=s["customer"],
        a=addr,
    )
    q(
        conn,
        "INSERT INTO order_line SELECT n, :o, i, q, 0, 'ordered' FROM unnest(CAST(:ns AS int[]), "
        "CAST(:ids AS int[]), CAST(:qs AS int[])) AS v(n, i, q)",
        o=order,
        ns=list(range(1, len(lines) + 1)),
        ids=[int(r[0]) for r in lines],
        qs=[int(r[1]) for r in lines],
    )
    q(
        conn,
        "UPDATE item SET i_stock = CASE WHEN i_stock - v.q < 10 THEN i_stock - v.q + 21 ELSE "
        "i_stock - v.q END "
        "FROM unnest(CAST(:ids AS int[]), CAST(:qs AS int[])) AS v(i, q) WHERE i_id = v.i",
        ids=[int(r[0]) for r in lines],
        qs=[int(r[1]) for r in lines],
    )
    q(
        conn,
        "INSERT INTO cc_xacts VALUES (:o, 'VISA', '4111111111111111', 'name', current_date + 365, "
        "'AUTH00000000000', 54, now(), 1)",
        o=order,
    )
    q(conn, "DELETE FROM shopping_cart_line WHERE scl_sc_id = :c", c=cart)


def order_inquiry(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    q(conn, "SELECT c_uname FROM customer WHERE c_id = :c", c=s["customer"] or _customer(rng, s))


def order_display(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    customer = s["customer"] or _customer(rng, s)
    rows = q(
        conn, "SELECT o_id FROM orders WHERE o_c_id = :c ORDER BY o_date DESC LIMIT 1", c=customer
    )
    if rows:
        q(
            conn,
            "SELECT ol_i_id, i_title, ol_qty, i_cost FROM order_line JOIN item ON ol_i_id = i_id "
            "WHERE ol_o_id = :o",
            o=rows[0][0],
        )
        q(conn, "SELECT * FROM cc_xacts WHERE cx_o_id = :o", o=rows[0][0])


def admin_request(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    product_detail(conn, rng, s)


def admin_confirm(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    item = _item(rng, s)
    related = [_item(rng, s) for _ in range(5)]
    q(
        conn,
        "UPDATE item SET i_cost = i_cost * 0.99, i_image = 'img/new', i_thumbnail = 'thumb/new', "
        "i_pub_date = current_date, i_related1 = :r1, i_related2 = :r2, i_related3 = :r3, "
        "i_related4 = :r4, "
        "i_related5 = :r5 WHERE i_id = :i",
        i=item,
        r1=related[0],
        r2=related[1],
        r3=related[2],
        r4=related[3],
        r5=related[4],
    )


class Tpcw:
    """The TPC-W-like workload (see the module doc string)."""

    name = "tpcw"
    database = "tpcw"
    per_minute_label = "web interactions/min"
    mixes: ClassVar[dict[str, dict[str, float]]] = {
        "browsing": _mix(0.95),
        "shopping": _mix(0.80),
        "ordering": _mix(0.50),
    }
    interactions: ClassVar[dict[str, Interaction]] = {
        "home": home,
        "new_products": new_products,
        "best_sellers": best_sellers,
        "product_detail": product_detail,
        "search_request": search_request,
        "search_results": search_results,
        "shopping_cart": shopping_cart,
        "customer_registration": customer_registration,
        "buy_request": buy_request,
        "buy_confirm": buy_confirm,
        "order_inquiry": order_inquiry,
        "order_display": order_display,
        "admin_request": admin_request,
        "admin_confirm": admin_confirm,
    }

    def session(self, conn: Any, client: int, rng: random.Random) -> dict[str, Any]:
        scale = scale_of(conn)
        return {
            "items": scale["items"],
            "authors": scale["authors"],
            "customers": scale["customers"],
            "subjects": scale["subjects"],
            "title_words": scale["title_words"],
            "best_seller_orders": scale["best_seller_orders"],
            "customer": None,
            "cart": None,
        }

"""TPC-C-like workload: our implementation of the five transactions.

Mixes are the study's Table 3: standard (New Order 45, Payment 43, Order
Status 4, Delivery 4, Stock Level 4) and high write (45/7/4/40/4). Inputs
follow the TPC-C specification: NURand customer and item choices, 60% of
customer look-ups by last name, 1% of new orders roll back on an unused item,
15% of payments for a remote warehouse. Each client has a home warehouse.
Throughput is reported in transactions per minute (all five kinds).
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

from .sql import q
from .workload import ExpectedRollback, Interaction, scale_of

C_LAST_RUN, C_ID_RUN, I_ID_RUN = 157, 259, 7911  # the NURand C constants of one run
SYLLABLES = ("BAR", "OUGHT", "ABLE", "PRI", "PRES", "ESE", "ANTI", "CALLY", "ATION", "EING")


class RollbackRequested(ExpectedRollback):
    """New Order's specified 1% rollback (an unused item number)."""


def nurand(rng: random.Random, a: int, x: int, y: int, c: int) -> int:
    """TPC-C's non-uniform random number NURand(A, x, y)."""
    return (((rng.randint(0, a) | rng.randint(x, y)) + c) % (y - x + 1)) + x


def last_name(n: int) -> str:
    return SYLLABLES[n // 100] + SYLLABLES[(n // 10) % 10] + SYLLABLES[n % 10]


def _customer_by_last_name(conn: Any, w: int, d: int, rng: random.Random) -> int:
    rows = q(
        conn,
        "SELECT c_id FROM customer WHERE c_w_id = :w AND c_d_id = :d AND c_last = :l ORDER BY "
        "c_first",
        w=w,
        d=d,
        l=last_name(nurand(rng, 255, 0, 999, C_LAST_RUN)),
    )
    if not rows:
        return nurand(rng, 1023, 1, 3000, C_ID_RUN)
    return int(rows[(len(rows) - 1) // 2][0])


def new_order(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    w, d = s["home"], rng.randint(1, s["districts"])
    c = nurand(rng, 1023, 1, s["customers"], C_ID_RUN)
    count = rng.randint(5, 15)
    items = sorted({nurand(rng, 8191, 1, s["items"], I_ID_RUN) for _ in range(count)})
    rollback = rng.random() < 0.01
    supply = [
        w if rng.random() < 0.99 or s["warehouses"] == 1 else rng.randint(1, s["warehouses"])
        for _ in items
    ]
    qty = [rng.randint(1, 10) for _ in items]
    q(conn, "SELECT w_tax FROM warehouse WHERE w_id = :w", w=w)
    ((_d_tax, o_id),) = q(
        conn,
        "UPDATE district SET d_next_o_id = d_next_o_id + 1 WHERE d_w_id = :w AND d_id = :d "
        "RETURNING d_tax, d_next_o_id - 1",
        w=w,
        d=d,
    )
    q(
        conn,
        "SELECT c_discount, c_last, c_credit FROM customer WHERE c_w_id = :w AND c_d_id = :d AND "
        "c_id = :c",
        w=w,
        d=d,
        c=c,
    )
    q(
        conn,
        "INSERT INTO orders VALUES (:w, :d, :o, :c, now(), NULL, :n, :local)",
        w=w,
        d=d,
        o=o_id,
        c=c,
        n=len(items),
        local=int(all(x == w for x in supply)),
    )
    q(conn, "INSERT INTO new_order VALUES (:w, :d, :o)", w=w, d=d, o=o_id)
    prices = dict(q(conn, "SELECT i_id, i_price FROM item WHERE i_id = ANY(:ids)", ids=items))
    if rollback or len(prices) < len(items):
        raise RollbackRequested()
    dist = f"s_dist_{d:02d}"
    stock = q(
        conn,
        f"UPDATE stock SET s_quantity = CASE WHEN s_quantity >= v.q + 10 THEN s_quantity - v.q "
        f"ELSE s_quantity - v.q + 91 END, s_ytd = s_ytd + v.q, s_order_cnt = s_order_cnt + 1, "
        f"s_remote_cnt = s_remote_cnt + (v.sw <> :w)::int "
        f"FROM unnest(CAST(:ids AS int[]), CAST(:sws AS int[]), CAST(:qs AS int[])) AS v(i, sw, q) "
        f"WHERE s_w_id = v.sw AND s_i_id = v.i RETURNING s_i_id, {dist}",
        w=w,
        ids=items,
        sws=supply,
        qs=qty,
    )
    dist_info = dict(stock)
    q(
        conn,
        "INSERT INTO order_line SELECT :w, :d, :o, n, i, sw, NULL, q, q * p, di "
        "FROM unnest(CAST(:ns AS int[]), CAST(:ids AS int[]), CAST(:sws AS int[]), CAST(:qs AS "
        "int[]), "
        "CAST(:ps AS numeric[]), CAST(:dis AS text[])) AS v(n, i, sw, q, p, di)",
        w=w,
        d=d,
        o=o_id,
        ns=list(range(1, len(items) + 1)),
        ids=items,
        sws=supply,
        qs=qty,
        ps=[prices[i] for i in items],
        dis=[dist_info.get(i, "") for i in items],
    )


def payment(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    w, d = s["home"], rng.randint(1, s["districts"])
    if rng.random() < 0.85 or s["warehouses"] == 1:
        cw, cd = w, d
    else:
        cw, cd = (
            rng.choice([x for x in range(1, s["warehouses"] + 1) if x != w]),
            rng.randint(1, s["districts"]),
        )
    amount = round(rng.uniform(1.0, 5000.0), 2)
    c = (
        _customer_by_last_name(conn, cw, cd, rng)
        if rng.random() < 0.6
        else nurand(rng, 1023, 1, s["customers"], C_ID_RUN)
    )
    q(conn, "UPDATE warehouse SET w_ytd = w_ytd + :h WHERE w_id = :w", h=amount, w=w)
    q(
        conn,
        "UPDATE district SET d_ytd = d_ytd + :h WHERE d_w_id = :w AND d_id = :d",
        h=amount,
        w=w,
        d=d,
    )
    q(
        conn,
        "UPDATE customer SET c_balance = c_balance - :h, c_ytd_payment = c_ytd_payment + :h, "
        "c_payment_cnt = c_payment_cnt + 1, c_data = CASE WHEN c_credit = 'BC' THEN "
        "substr(:info || c_data, 1, 500) ELSE c_data END WHERE c_w_id = :w AND c_d_id = :d AND "
        "c_id = :c",
        h=amount,
        info=f"{c} {cd} {cw} {d} {w} {amount} ",
        w=cw,
        d=cd,
        c=c,
    )
    q(
        conn,
        "INSERT INTO history VALUES (:c, :cd, :cw, :d, :w, now(), :h, 'payment')",
        c=c,
        cd=cd,
        cw=cw,
        d=d,
        w=w,
        h=amount,
    )


def order_status(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    w, d = s["home"], rng.randint(1, s["districts"])
    c = (
        _customer_by_last_name(conn, w, d, rng)
        if rng.random() < 0.6
        else nurand(rng, 1023, 1, s["customers"], C_ID_RUN)
    )
    q(
        conn,
        "SELECT c_balance, c_first, c_middle, c_last FROM customer WHERE c_w_id = :w AND c_d_id = "
        ":d "
        "AND c_id = :c",
        w=w,
        d=d,
        c=c,
    )
    q(
        conn,
        "SELECT ol_i_id, ol_supply_w_id, ol_quantity, ol_amount, ol_delivery_d FROM order_line "
        "WHERE ol_w_id = :w AND ol_d_id = :d AND ol_o_id = (SELECT max(o_id) FROM orders "
        "WHERE o_w_id = :w AND o_d_id = :d AND o_c_id = :c)",
        w=w,
        d=d,
        c=c,
    )


def delivery(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    w, carrier = s["home"], rng.randint(1, 10)
    for d in range(1, s["districts"] + 1):
        q(
            conn,
            "WITH no AS (DELETE FROM new_order WHERE (no_w_id, no_d_id, no_o_id) IN "
            "  (SELECT no_w_id, no_d_id, no_o_id FROM new_order WHERE no_w_id = :w AND no_d_id = "
            ":d "
            "   ORDER BY no_o_id LIMIT 1 FOR UPDATE SKIP LOCKED) RETURNING no_o_id), "
            "o AS (UPDATE orders SET o_carrier_id = :car FROM no WHERE o_w_id = :w AND o_d_id = :d "
            "  AND o_id = no.no_o_id RETURNING o_id, o_c_id), "
            "ol AS (UPDATE order_line SET ol_delivery_d = now() FROM o WHERE ol_w_id = :w AND "
            "ol_d_id = :d "
            "  AND ol_o_id = o.o_id RETURNING ol_amount) "
            "UPDATE customer SET c_balance = c_balance + (SELECT coalesce(sum(ol_amount), 0) FROM "
            "ol), "
            "c_delivery_cnt = c_delivery_cnt + 1 FROM o WHERE c_w_id = :w AND c_d_id = :d AND "
            "c_id = o.o_c_id",
            w=w,
            d=d,
            car=carrier,
        )


def stock_level(conn: Any, rng: random.Random, s: dict[str, Any]) -> None:
    w, d = s["home"], s["district"]
    q(
        conn,
        "SELECT count(DISTINCT s_i_id) FROM order_line JOIN stock ON s_w_id = :w AND s_i_id = "
        "ol_i_id "
        "WHERE ol_w_id = :w AND ol_d_id = :d AND s_quantity < :t AND ol_o_id >= "
        "(SELECT d_next_o_id - 20 FROM district WHERE d_w_id = :w AND d_id = :d) AND ol_o_id < "
        "(SELECT d_next_o_id FROM district WHERE d_w_id = :w AND d_id = :d)",
        w=w,
        d=d,
        t=rng.randint(10, 20),
    )


class Tpcc:
    """The TPC-C-like workload (see the module doc string)."""

    name = "tpcc"
    database = "tpcc"
    per_minute_label = "transactions/min"
    mixes: ClassVar[dict[str, dict[str, float]]] = {
        "standard": {
            "new_order": 45,
            "payment": 43,
            "order_status": 4,
            "delivery": 4,
            "stock_level": 4,
        },
        "highwrite": {
            "new_order": 45,
            "payment": 7,
            "order_status": 4,
            "delivery": 40,
            "stock_level": 4,
        },
    }
    interactions: ClassVar[dict[str, Interaction]] = {
        "new_order": new_order,
        "payment": payment,
        "order_status": order_status,
        "delivery": delivery,
        "stock_level": stock_level,
    }

    def session(self, conn: Any, client: int, rng: random.Random) -> dict[str, Any]:
        scale = scale_of(conn)
        return {
            "home": client % scale["warehouses"] + 1,
            "district": client // scale["warehouses"] % 10 + 1,
            "warehouses": scale["warehouses"],
            "districts": scale["districts"],
            "customers": scale["customers"],
            "items": scale["items"],
        }

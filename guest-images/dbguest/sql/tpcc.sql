-- TPC-C-like database (our own schema after the TPC-C specification's nine
-- tables; row sizes as in the study's Table 7). 8 warehouses, about 0.8 GiB:
-- 3-4x the 256 MiB guest, as the study's 2.1 GB database was 4x 512 MB.
SELECT setseed(0.1);

CREATE TABLE scale (name text PRIMARY KEY, value bigint NOT NULL);
INSERT INTO scale VALUES ('warehouses', 8), ('districts', 10), ('customers', 3000), ('items', 100000),
                         ('orders', 3000), ('new_orders_from', 2101);

CREATE TABLE warehouse (w_id int PRIMARY KEY, w_name varchar(10), w_street varchar(40), w_city varchar(20),
    w_state char(2), w_zip char(9), w_tax numeric(4,4), w_ytd numeric(12,2));
CREATE TABLE district (d_w_id int, d_id int, d_name varchar(10), d_street varchar(40), d_city varchar(20),
    d_state char(2), d_zip char(9), d_tax numeric(4,4), d_ytd numeric(12,2), d_next_o_id int,
    PRIMARY KEY (d_w_id, d_id));
CREATE TABLE customer (c_w_id int, c_d_id int, c_id int, c_first varchar(16), c_middle char(2),
    c_last varchar(16), c_street varchar(40), c_city varchar(20), c_state char(2), c_zip char(9),
    c_phone char(16), c_since timestamp, c_credit char(2), c_credit_lim numeric(12,2),
    c_discount numeric(4,4), c_balance numeric(12,2), c_ytd_payment numeric(12,2),
    c_payment_cnt int, c_delivery_cnt int, c_data varchar(500),
    PRIMARY KEY (c_w_id, c_d_id, c_id));
CREATE TABLE history (h_c_id int, h_c_d_id int, h_c_w_id int, h_d_id int, h_w_id int, h_date timestamp,
    h_amount numeric(6,2), h_data varchar(24));
CREATE TABLE orders (o_w_id int, o_d_id int, o_id int, o_c_id int, o_entry_d timestamp, o_carrier_id int,
    o_ol_cnt int, o_all_local int, PRIMARY KEY (o_w_id, o_d_id, o_id));
CREATE TABLE new_order (no_w_id int, no_d_id int, no_o_id int, PRIMARY KEY (no_w_id, no_d_id, no_o_id));
CREATE TABLE order_line (ol_w_id int, ol_d_id int, ol_o_id int, ol_number int, ol_i_id int,
    ol_supply_w_id int, ol_delivery_d timestamp, ol_quantity int, ol_amount numeric(6,2),
    ol_dist_info char(24), PRIMARY KEY (ol_w_id, ol_d_id, ol_o_id, ol_number));
CREATE TABLE item (i_id int PRIMARY KEY, i_im_id int, i_name varchar(24), i_price numeric(5,2),
    i_data varchar(50));
CREATE TABLE stock (s_w_id int, s_i_id int, s_quantity int, s_dist_01 char(24), s_dist_02 char(24),
    s_dist_03 char(24), s_dist_04 char(24), s_dist_05 char(24), s_dist_06 char(24), s_dist_07 char(24),
    s_dist_08 char(24), s_dist_09 char(24), s_dist_10 char(24), s_ytd int, s_order_cnt int,
    s_remote_cnt int, s_data varchar(50), PRIMARY KEY (s_w_id, s_i_id));

-- TPC-C last names: three syllables indexed by the digits of a number < 1000.
CREATE FUNCTION c_last_name(n int) RETURNS text LANGUAGE sql IMMUTABLE AS $$
  SELECT (ARRAY['BAR','OUGHT','ABLE','PRI','PRES','ESE','ANTI','CALLY','ATION','EING'])[n / 100 + 1]
      || (ARRAY['BAR','OUGHT','ABLE','PRI','PRES','ESE','ANTI','CALLY','ATION','EING'])[(n / 10) % 10 + 1]
      || (ARRAY['BAR','OUGHT','ABLE','PRI','PRES','ESE','ANTI','CALLY','ATION','EING'])[n % 10 + 1] $$;

INSERT INTO item SELECT i, 1 + (random() * 9999)::int, substr(md5(i::text), 1, 14 + i % 10),
    1 + (random() * 99)::numeric(5,2), rpad(md5(i::text || 'd'), 26 + i % 24, 'x')
  FROM generate_series(1, 100000) i;
INSERT INTO warehouse SELECT w, 'wh' || w, rpad('street', 20, 'x'), 'city', 'OH', '123451111',
    (random() * 0.2)::numeric(4,4), 300000 FROM generate_series(1, 8) w;
INSERT INTO district SELECT w, d, 'd' || d, rpad('street', 20, 'x'), 'city', 'OH', '123451111',
    (random() * 0.2)::numeric(4,4), 30000, 3001 FROM generate_series(1, 8) w, generate_series(1, 10) d;
INSERT INTO customer SELECT w, d, c, substr(md5(c::text), 1, 12), 'OE',
    c_last_name(CASE WHEN c <= 1000 THEN c - 1 ELSE (random() * 999)::int END),
    rpad('street', 20, 'x'), 'city', 'OH', '123451111', '0123456789012345', now(),
    CASE WHEN random() < 0.1 THEN 'BC' ELSE 'GC' END, 50000, (random() * 0.5)::numeric(4,4), -10, 10, 1, 0,
    rpad(md5(c::text || w::text), 300 + (c % 200), md5(d::text))
  FROM generate_series(1, 8) w, generate_series(1, 10) d, generate_series(1, 3000) c;
CREATE INDEX customer_last ON customer (c_w_id, c_d_id, c_last, c_first);
INSERT INTO history SELECT c, d, w, d, w, now(), 10, rpad(md5(c::text), 12 + c % 12, 'h')
  FROM generate_series(1, 8) w, generate_series(1, 10) d, generate_series(1, 3000) c;
INSERT INTO stock SELECT w, i, 10 + (random() * 90)::int,
    md5(i::text || '1')::char(24), md5(i::text || '2')::char(24), md5(i::text || '3')::char(24),
    md5(i::text || '4')::char(24), md5(i::text || '5')::char(24), md5(i::text || '6')::char(24),
    md5(i::text || '7')::char(24), md5(i::text || '8')::char(24), md5(i::text || '9')::char(24),
    md5(i::text || '0')::char(24), 0, 0, 0, rpad(md5(w::text || i::text), 26 + i % 24, 's')
  FROM generate_series(1, 8) w, generate_series(1, 100000) i;
-- Orders 1..3000 per district, customers in a random permutation; 2101.. are undelivered.
INSERT INTO orders SELECT w, d, o, c, now(), CASE WHEN o < 2101 THEN 1 + (random() * 9)::int END,
    5 + (o * 7 + d) % 11, 1
  FROM generate_series(1, 8) w, generate_series(1, 10) d,
       LATERAL (SELECT row_number() OVER () AS o, c FROM
                (SELECT c FROM generate_series(1, 3000) c ORDER BY random()) p) perm;
INSERT INTO new_order SELECT o_w_id, o_d_id, o_id FROM orders WHERE o_id >= 2101;
INSERT INTO order_line SELECT o_w_id, o_d_id, o_id, n, 1 + (random() * 99999)::int, o_w_id,
    CASE WHEN o_id < 2101 THEN o_entry_d END, 5,
    CASE WHEN o_id < 2101 THEN 0 ELSE (random() * 9999)::numeric(6,2) END, md5(n::text)::char(24)
  FROM orders, LATERAL generate_series(1, o_ol_cnt) n;
CREATE INDEX orders_customer ON orders (o_w_id, o_d_id, o_c_id, o_id);

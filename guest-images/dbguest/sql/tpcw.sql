-- TPC-W-like bookstore database (our own schema after the TPC-W tables; row
-- sizes as in the study's Table 5, cardinalities at 0.3 of the study's
-- 1,000,000-item store): about 0.65 GiB, 2.5x the 256 MiB guest.
SELECT setseed(0.2);

CREATE TABLE scale (name text PRIMARY KEY, value bigint NOT NULL);
INSERT INTO scale VALUES ('items', 300000), ('authors', 75000), ('customers', 430000), ('addresses', 860000),
                         ('orders', 390000), ('countries', 92), ('subjects', 24), ('title_words', 400),
                         ('best_seller_orders', 1000);

CREATE TABLE country (co_id int PRIMARY KEY, co_name varchar(50), co_exchange numeric(6,2), co_currency varchar(18));
CREATE TABLE author (a_id int PRIMARY KEY, a_fname varchar(20), a_lname varchar(20), a_mname varchar(20),
    a_dob date, a_bio varchar(500));
CREATE TABLE item (i_id int PRIMARY KEY, i_title varchar(60), i_a_id int, i_pub_date date, i_publisher varchar(60),
    i_subject int, i_desc varchar(500), i_related1 int, i_related2 int, i_related3 int, i_related4 int,
    i_related5 int, i_thumbnail varchar(40), i_image varchar(40), i_srp numeric(10,2), i_cost numeric(10,2),
    i_avail date, i_stock int, i_isbn char(13), i_page int, i_backing varchar(15), i_dimensions varchar(25));
CREATE TABLE customer (c_id int PRIMARY KEY, c_uname varchar(20), c_passwd varchar(20), c_fname varchar(17),
    c_lname varchar(17), c_addr_id int, c_phone varchar(18), c_email varchar(50), c_since date,
    c_last_login date, c_login timestamp, c_expiration timestamp, c_discount numeric(4,2),
    c_balance numeric(10,2), c_ytd_pmt numeric(10,2), c_birthdate date, c_data varchar(100));
CREATE TABLE address (addr_id int PRIMARY KEY, addr_street1 varchar(40), addr_street2 varchar(40),
    addr_city varchar(30), addr_state varchar(20), addr_zip varchar(10), addr_co_id int);
CREATE TABLE orders (o_id int PRIMARY KEY, o_c_id int, o_date timestamp, o_sub_total numeric(10,2),
    o_tax numeric(10,2), o_total numeric(10,2), o_ship_type varchar(10), o_ship_date timestamp,
    o_bill_addr_id int, o_ship_addr_id int, o_status varchar(15));
CREATE TABLE order_line (ol_id int, ol_o_id int, ol_i_id int, ol_qty int, ol_discount numeric(4,2),
    ol_comments varchar(110), PRIMARY KEY (ol_o_id, ol_id));
CREATE TABLE cc_xacts (cx_o_id int PRIMARY KEY, cx_type varchar(10), cx_num char(16), cx_name varchar(31),
    cx_expire date, cx_auth_id char(15), cx_xact_amt numeric(10,2), cx_xact_date timestamp, cx_co_id int);
CREATE TABLE shopping_cart (sc_id serial PRIMARY KEY, sc_time timestamp);
CREATE TABLE shopping_cart_line (scl_sc_id int, scl_qty int, scl_i_id int, PRIMARY KEY (scl_sc_id, scl_i_id));

-- Title words: 400 made-up words; a title has three of them.
CREATE FUNCTION title_word(n int) RETURNS text LANGUAGE sql IMMUTABLE AS $$
  SELECT 'w' || substr(md5('word' || n::text), 1, 6) $$;

INSERT INTO country SELECT n, 'country' || n, 1 + n / 10.0, 'cur' || n FROM generate_series(1, 92) n;
INSERT INTO author SELECT a, substr(md5(a::text), 1, 10), 'L' || substr(md5(a::text || 'l'), 1, 9),
    substr(md5(a::text || 'm'), 1, 8), date '1950-01-01' + a % 15000, rpad(md5(a::text), 120 + a % 150, 'b')
  FROM generate_series(1, 75000) a;
INSERT INTO item SELECT i,
    title_word((random() * 399)::int) || ' ' || title_word((random() * 399)::int) || ' ' || title_word((random() * 399)::int),
    1 + (random() * 74999)::int, date '1990-01-01' + (random() * 12000)::int, 'pub' || i % 1000,
    (random() * 23)::int, rpad(md5(i::text), 150 + i % 200, 'd'),
    1 + (random() * 299999)::int, 1 + (random() * 299999)::int, 1 + (random() * 299999)::int,
    1 + (random() * 299999)::int, 1 + (random() * 299999)::int, 'thumb/' || i, 'img/' || i,
    10 + (random() * 90)::numeric(10,2), 5 + (random() * 50)::numeric(10,2), current_date, 10 + (random() * 20)::int,
    lpad(i::text, 13, '0'), 20 + i % 900, 'paperback', '10x20x3'
  FROM generate_series(1, 300000) i;
-- No index on i_subject: New Products and the search by subject scan the item table, the sequential scans of
-- the items band that the study describes for TPC-W (its Figure 3).
CREATE INDEX item_author ON item (i_a_id);
CREATE INDEX author_lname ON author (a_lname text_pattern_ops);
INSERT INTO address SELECT a, rpad('street' || a, 30, 's'), rpad('apt', 20, 'a'), 'city' || a % 5000,
    'state' || a % 50, lpad((a % 99999)::text, 5, '0'), 1 + a % 92 FROM generate_series(1, 860000) a;
INSERT INTO customer SELECT c, 'user' || c, 'pw' || c, substr(md5(c::text), 1, 12), substr(md5(c::text || 'x'), 1, 12),
    2 * c - 1, '555-' || c, 'user' || c || '@example.invalid', date '2000-01-01' + c % 3000, current_date,
    now(), now() + interval '2 hours', (random() * 0.5)::numeric(4,2), 0, 0, date '1960-01-01' + c % 15000,
    rpad(md5(c::text), 60 + c % 40, 'c')
  FROM generate_series(1, 430000) c;
CREATE UNIQUE INDEX customer_uname ON customer (c_uname);
INSERT INTO orders SELECT o, 1 + (random() * 429999)::int, now() - (390000 - o) * interval '1 minute',
    50, 4, 54, 'UPS', now(), 1 + (random() * 859999)::int, 1 + (random() * 859999)::int, 'SHIPPED'
  FROM generate_series(1, 390000) o;
CREATE INDEX orders_customer ON orders (o_c_id, o_date DESC);
INSERT INTO order_line SELECT l, o, 1 + (random() * 299999)::int, 1 + (random() * 4)::int, 0,
    rpad(md5(o::text || l::text), 60 + (o + l) % 50, 'o')
  FROM generate_series(1, 390000) o, LATERAL generate_series(1, 1 + (o % 5)) l;
INSERT INTO cc_xacts SELECT o, 'VISA', lpad(o::text, 16, '4'), 'name' || o, current_date + 365,
    lpad(o::text, 15, 'A'), 54, now(), 1 + o % 92 FROM generate_series(1, 390000) o;
CREATE SEQUENCE customer_seq START 430001;
CREATE SEQUENCE address_seq START 860001;
CREATE SEQUENCE orders_seq START 390001;

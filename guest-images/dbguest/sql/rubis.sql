-- RUBiS-like auction database (our own schema after RUBiS's tables; row
-- sizes as in the study's Table 6, cardinalities at 0.3 of the study's):
-- about 0.3 GiB, 1.2x the 256 MiB guest (the study's 0.5 GB was 1x 512 MB).
SELECT setseed(0.3);

CREATE TABLE scale (name text PRIMARY KEY, value bigint NOT NULL);
INSERT INTO scale VALUES ('users', 300000), ('items', 160000), ('active_items', 10000), ('bids', 1130000),
                         ('comments', 120000), ('categories', 20), ('regions', 62);

CREATE TABLE categories (id int PRIMARY KEY, name varchar(50));
CREATE TABLE regions (id int PRIMARY KEY, name varchar(25));
CREATE TABLE users (id serial PRIMARY KEY, firstname varchar(20), lastname varchar(20), nickname varchar(20),
    password varchar(20), email varchar(50), rating int, balance numeric(10,2), creation_date timestamp,
    region int);
CREATE TABLE items (id serial PRIMARY KEY, name varchar(100), description text, initial_price numeric(10,2),
    quantity int, reserve_price numeric(10,2), buy_now numeric(10,2), nb_of_bids int, max_bid numeric(10,2),
    start_date timestamp, end_date timestamp, seller int, category int);
CREATE TABLE bids (id serial PRIMARY KEY, user_id int, item_id int, qty int, bid numeric(10,2),
    max_bid numeric(10,2), date timestamp);
CREATE TABLE comments (id serial PRIMARY KEY, from_user_id int, to_user_id int, item_id int, rating int,
    date timestamp, comment varchar(255));
CREATE TABLE buy_now (id serial PRIMARY KEY, buyer_id int, item_id int, qty int, date timestamp);

INSERT INTO categories SELECT n, 'category' || n FROM generate_series(1, 20) n;
INSERT INTO regions SELECT n, 'region' || n FROM generate_series(1, 62) n;
INSERT INTO users (firstname, lastname, nickname, password, email, rating, balance, creation_date, region)
  SELECT 'first' || u, 'last' || u, 'user' || u, 'pw' || u, 'user' || u || '@example.invalid',
    (random() * 10)::int, 0, now() - (u % 1000) * interval '1 day', 1 + u % 62
  FROM generate_series(1, 300000) u;
-- The last 10,000 items are the open auctions (end_date in the future); the rest have ended.
INSERT INTO items (name, description, initial_price, quantity, reserve_price, buy_now, nb_of_bids, max_bid,
                   start_date, end_date, seller, category)
  SELECT 'item' || i, rpad(md5(i::text), 250 + i % 400, 'd'), 10, 1 + i % 3, 15, 30, 7, 17,
    now() - interval '7 days' + (i - 160000) * interval '20 seconds',
    CASE WHEN i > 150000 THEN now() + (i - 150000) * interval '1 minute'
         ELSE now() - interval '1 day' - (150000 - i) * interval '1 minute' END,
    1 + (random() * 299999)::int, 1 + i % 20
  FROM generate_series(1, 160000) i;
CREATE INDEX items_category ON items (category, end_date);
CREATE INDEX items_seller ON items (seller);
CREATE UNIQUE INDEX users_nickname ON users (nickname);
INSERT INTO bids (user_id, item_id, qty, bid, max_bid, date)
  SELECT 1 + (random() * 299999)::int, 1 + (b % 160000), 1, 10 + b % 7, 12 + b % 7, now() - interval '1 day'
  FROM generate_series(1, 1130000) b;
CREATE INDEX bids_item ON bids (item_id);
CREATE INDEX bids_user ON bids (user_id);
INSERT INTO comments (from_user_id, to_user_id, item_id, rating, date, comment)
  SELECT 1 + (random() * 299999)::int, 1 + (random() * 299999)::int, 1 + (random() * 159999)::int,
    (random() * 10)::int - 5, now(), rpad(md5(c::text), 120 + c % 130, 'c')
  FROM generate_series(1, 120000) c;
CREATE INDEX comments_to_user ON comments (to_user_id);

// The host reference of write / attend / update_and_attend on cases whose answers follow from
// the definition by hand: one visible key returns its value, equal scores average, GQA maps query
// head h to KV head h / g, the scale sharpens the softmax, and a row that sees nothing is zeros.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "cellkv/kv_cache.hpp"
#include "cellkv/reference.hpp"
#include "support.hpp"

namespace {

using namespace cellkv;

struct Pool {
  std::vector<double> k, v;
  PoolView<double> view(std::int32_t heads_kv, std::int32_t head_dim) {
    return {k.data(), v.data(), static_cast<std::int64_t>(k.size()) / (heads_kv * head_dim), heads_kv, head_dim};
  }
};

}  // namespace

TEST_CASE("reference attend: one visible key returns its value; equal scores average") {
  // 3 rows, 1 KV head, D = 2. Query (1, 0).
  Pool pool{{1, 0, 1, 0, 5, 5}, {10, 20, 30, 40, 99, 99}};
  const std::vector<double> q{1, 0};
  std::vector<double> out(2, -1);
  auto view = pool.view(1, 2);
  const PoolView<const double> read{view.k, view.v, view.rows, 1, 2};
  reference::attend<double>(q, read, out, 1, 3, 1.0f, [](std::int32_t, std::int64_t c) { return c == 1; });
  CHECK(out == std::vector<double>{30, 40});
  // rows 0 and 1 have equal keys: the output is the mean of their values; row 2 is not visible.
  reference::attend<double>(q, read, out, 1, 3, 1.0f, [](std::int32_t, std::int64_t c) { return c < 2; });
  CHECK(out[0] == doctest::Approx(20));
  CHECK(out[1] == doctest::Approx(30));
}

TEST_CASE("reference attend: softmax weights follow exp(scale * q.k)") {
  Pool pool{{0, 0, 1, 0}, {1, 0, 0, 1}};  // keys (0,0) and (1,0); values e0 and e1
  const std::vector<double> q{2, 0};
  std::vector<double> out(2);
  auto view = pool.view(1, 2);
  const PoolView<const double> read{view.k, view.v, view.rows, 1, 2};
  const float scale = 0.5f;  // scores 0 and 1
  reference::attend<double>(q, read, out, 1, 2, scale, [](std::int32_t, std::int64_t) { return true; });
  const double e = std::exp(1.0);
  CHECK(out[0] == doctest::Approx(1 / (1 + e)));
  CHECK(out[1] == doctest::Approx(e / (1 + e)));
}

TEST_CASE("reference attend: GQA maps query head h to KV head h / g; nothing visible gives zeros") {
  // 1 row, 2 KV heads, D = 1; 4 query heads (g = 2). Token 1 sees nothing.
  Pool pool{{1, 1}, {7, 9}};
  const std::vector<double> q(8, 1.0);
  std::vector<double> out(8, -1);
  auto view = pool.view(2, 1);
  const PoolView<const double> read{view.k, view.v, view.rows, 2, 1};
  reference::attend<double>(q, read, out, 4, 1, 1.0f, [](std::int32_t t, std::int64_t) { return t == 0; });
  CHECK(out == std::vector<double>{7, 7, 9, 9, 0, 0, 0, 0});
}

TEST_CASE("reference update_and_attend: writes the step's rows, then attends through the cache's mask") {
  using Cache = CellCache<Windows<0, 1>>;
  Cache cache({.max_write = 4, .max_cells = 8});
  Pool pool{std::vector<double>(8, -5), std::vector<double>(8, -5)};  // 8 rows, 1 head, D = 1
  const std::vector<double> q{1, 1}, k{0, 0}, v{3, 5};
  std::vector<double> out(2, -1);
  CHECK(reference::update_and_attend(cache, 0, pool.view(1, 1), std::span<const double>(q), std::span<const double>(k),
                                     std::span<const double>(v), std::span<double>(out), 1, 1.0f) ==
        Errc::no_step_declared);
  CHECK(pool.v == std::vector<double>(8, -5));  // refused: nothing written

  const auto a = cache.seq_new().value();
  REQUIRE(test::declare(cache, {a, a}).ok());
  const std::vector<double> short_q{1};
  CHECK(reference::update_and_attend(cache, 0, pool.view(1, 1), std::span<const double>(short_q),
                                     std::span<const double>(k), std::span<const double>(v), std::span<double>(out), 1,
                                     1.0f) == Errc::bad_shape);
  CHECK(pool.v == std::vector<double>(8, -5));
  CHECK(reference::update_and_attend(cache, 0, pool.view(1, 1), std::span<const double>(q), std::span<const double>(k),
                                     std::span<const double>(v), std::span<double>(out), 0, 1.0f) ==
        Errc::bad_head_ratio);

  REQUIRE(reference::update_and_attend(cache, 0, pool.view(1, 1), std::span<const double>(q),
                                       std::span<const double>(k), std::span<const double>(v), std::span<double>(out),
                                       1, 1.0f)
              .ok());
  CHECK(pool.v[0] == 3);
  CHECK(pool.v[1] == 5);
  CHECK(out[0] == doctest::Approx(3));  // sees itself only
  CHECK(out[1] == doctest::Approx(4));  // equal scores over rows 0 and 1
  REQUIRE(reference::update_and_attend(cache, 1, pool.view(1, 1), std::span<const double>(q),
                                       std::span<const double>(k), std::span<const double>(v), std::span<double>(out),
                                       1, 1.0f)
              .ok());
  CHECK(out[1] == doctest::Approx(5));  // window 1: itself only
}

// cell_map: three sequences and a fork walked through a few steps of the cell layout, with the cell
// map and every window's mask rows drawn in the terminal. Checks each mask row against the
// visibility rule (docs/design.md section 3) computed here from the cells' metadata; exits 1 on a mismatch.
//
//   build/examples/cellkv-cell-map
#include <cellkv/cellkv.hpp>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace {

// Two layers use the full causal history, one a sliding window of 3 positions.
using Model = cellkv::Windows<0, 3, 0>;
using Cache = cellkv::CellCache<Model, cellkv::placement::lowest_free, 8>;

constexpr std::int32_t kCells = 24;

char name_of(std::int32_t seq) { return static_cast<char>('A' + seq); }

// Owner letters of a cell ('.' when free, '*' when shared by several sequences).
char owner_glyph(const Cache& cache, std::int32_t c) {
  const auto& owners = cache.cell_owners(c);
  if (owners.empty()) return '.';
  return owners.count() > 1 ? '*' : name_of(owners.first());
}

void draw_cell_map(const Cache& cache) {
  std::printf("  cell   ");
  for (std::int32_t c = 0; c < kCells; ++c) std::printf("%3d", c);
  std::printf("\n  owner  ");
  for (std::int32_t c = 0; c < kCells; ++c) std::printf("%3c", owner_glyph(cache, c));
  std::printf("\n  pos    ");
  for (std::int32_t c = 0; c < kCells; ++c) {
    if (cache.cell_pos(c) < 0) std::printf("  .");
    else std::printf("%3d", cache.cell_pos(c));
  }
  std::printf("\n");
  for (std::int32_t c = 0; c < kCells; ++c) {
    if (cache.cell_owners(c).count() < 2) continue;
    std::string who;
    cache.cell_owners(c).for_each([&](std::int32_t s) { who += name_of(s); });
    std::printf("  cell %d is shared by %s\n", c, who.c_str());
  }
}

// The visibility rule, from the cells' metadata alone.
bool rule_says_visible(const Cache& cache, std::int32_t seq, std::int32_t pos, std::int32_t window, std::int32_t c) {
  const std::int32_t cp = cache.cell_pos(c);
  return cp >= 0 && cache.cell_owners(c).test(seq) && cellkv::sees(window, pos, cp);
}

// Draws each window's mask rows for the placed step; returns the number of bits that disagree
// with the rule.
int draw_and_check_masks(const Cache& cache) {
  const auto plan = cache.step();
  int mismatches = 0;
  std::vector<std::uint8_t> row(static_cast<std::size_t>(plan.read_len));
  for (std::int32_t b = 0; b < Model::kDistinct; ++b) {
    const std::int32_t w = Model::kDistinctWindows[static_cast<std::size_t>(b)];
    std::printf("  mask_w%d (buffer %d), read_len %lld:\n", w, b, static_cast<long long>(plan.read_len));
    for (std::int32_t t = 0; t < plan.tokens; ++t) {
      const std::int32_t seq = plan.seqs[static_cast<std::size_t>(t)], pos = plan.positions[static_cast<std::size_t>(t)];
      if (!cache.mask_row(w, t, row).ok()) return 1;  // a placed step and a row of read_len: never refused
      std::printf("    t%-2d %c@%-3d", t, name_of(seq), pos);
      for (std::int32_t c = 0; c < plan.read_len; ++c) {
        const bool got = row[static_cast<std::size_t>(c)] != 0;
        const bool want = rule_says_visible(cache, seq, pos, w, c);
        mismatches += got != want;
        std::printf("%3c", got == want ? (got ? '#' : '.') : '!');
      }
      std::printf("\n");
    }
  }
  return mismatches;
}

int run_step(Cache& cache, const char* title, const std::vector<std::int32_t>& seqs) {
  std::printf("\n== %s\n", title);
  const auto plan = cache.declare_step(seqs);
  if (!plan.ok()) {
    std::printf("  refused: %s\n", std::string(plan.status().message()).c_str());
    return 1;
  }
  std::printf("  tokens ");
  for (std::int32_t t = 0; t < plan.value().tokens; ++t)
    std::printf(" %c@%d->cell %lld", name_of(plan.value().seqs[static_cast<std::size_t>(t)]),
                plan.value().positions[static_cast<std::size_t>(t)],
                static_cast<long long>(plan.value().rows[static_cast<std::size_t>(t)]));
  std::printf("\n");
  draw_cell_map(cache);
  return draw_and_check_masks(cache);
}

}  // namespace

int main() {
  std::printf("cellkv cell map: windows per layer {0, 3, 0} -> %d mask buffers; %d cells, lowest_free placement\n",
              Model::kDistinct, kCells);
  Cache cache({.max_write = 8, .max_cells = kCells});
  const std::int32_t a = cache.seq_new().value(), b = cache.seq_new().value(), c = cache.seq_new().value();
  int bad = 0;
  bad += run_step(cache, "prefill A (4 tokens) and B (3 tokens) together: block-diagonal causal", {a, a, a, a, b, b, b});
  bad += run_step(cache, "decode A and B, prefill C (2 tokens)", {a, b, c, c});
  const std::int32_t d = cache.seq_clone(a, 3).value();
  std::printf("\n-- D = fork of A's first 3 positions (zero copy: the cells gain an owner)\n");
  bad += run_step(cache, "decode A, C and the fork D", {a, c, d});
  (void)cache.rewind(b, 1);
  std::printf("\n-- B rewound to 1 position: its cells for positions 1..3 are holes now\n");
  bad += run_step(cache, "B refills the holes; A decodes twice in one step", {b, b, a, a});
  (void)cache.seq_rm(a);
  std::printf("\n-- A removed: cells only A held are free, cells shared with D stay\n");
  bad += run_step(cache, "decode D and C", {d, c});
  std::printf("\n%s: %d mask bits disagree with the visibility rule\n", bad == 0 ? "OK" : "FAILED", bad);
  return bad == 0 ? 0 : 1;
}

// Compiled with -DCELLKV_MAX_SEQS=N by check.sh: a cache and a SeqSet of MaxSeqs = N. Values
// outside [1, 65536] must fail to compile with the static_assert's message.
#include "cellkv/kv_cache.hpp"

using Cache = cellkv::CellCache<cellkv::Windows<0>, cellkv::placement::lowest_free, CELLKV_MAX_SEQS>;
using Slots = cellkv::SequenceCache<cellkv::Windows<0>, CELLKV_MAX_SEQS>;

Cache* make_cells() { return new Cache({.max_write = 1, .max_cells = 1}); }
Slots* make_slots() { return new Slots({.max_write = 1, .max_len = 1}); }
bool empty_set() { return cellkv::SeqSet<CELLKV_MAX_SEQS>{}.empty(); }

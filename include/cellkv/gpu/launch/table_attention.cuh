// cellkv/gpu/launch/table_attention.cuh - the attention of a cache read through its position
// tables (or the sequence layout's slots): the scratch the kernels need, allocated once, and the
// launches of one layer's attention.
//
// Per layer, on the caller's stream (capturable: grids depend on the cache's sizes only, and the
// kernels read the step's work from the step block):
//   shared_prefix_attention  the step's shared prefixes (cell layout), read once for all who share
//                            them; partial results per token, run and KV split (prefix_sharing.hpp);
//                            shared_prefix_wgmma instead under prefill_wgmma's conditions (below;
//                            each kernel's register fit checked for itself), which also finishes
//                            the decode segments with at most kMaxFinishOwn own positions
//                            (shared_finish.cuh): they are no decode work
//   decode_attention    the decode segments, split evenly over one worker per warp, merged in-kernel
//   prefill_attention   the prefill items, on a forked stream so both kinds of segment run together;
//                       prefill_wgmma instead where the device runs sm_90a code (wgmma: Hopper),
//                       the pool stores bf16 / fp16, D is 64, 128 or 256 (its shared-prefix kernel:
//                       64 or 128) and the kernel's launch
//                       registers cover its warpgroups' setmaxnreg split. Setting the environment
//                       variable CELLKV_PREFILL_KERNEL=mma before a cache is made keeps the
//                       mma.sync kernels, prefill and shared prefix (tests compare the two).
// The last two fold the shared partials (every split of every run of a token) into their outputs.
// Outside graph capture a kernel with no work in the uploaded step is not launched at all. On sm_90
// and later every one of them is a dependent launch (kernels/dependent_launch.cuh), except the
// prefill kernel on the forked stream of a step with both kinds of segment (it follows an event):
// it is scheduled while the kernel before it finishes, reads the step's plan (work, segments,
// position tables) and waits for that kernel before it reads q or the pool; the shared-prefix and
// prefill kernels wait as they start, the decode kernel after its first table reads.
//
// Supported, written out: element types __nv_bfloat16 and __half (fp32 accumulation) and fp8
// storage of either (gpu::Fp8<In>: E4M3 codes with a scale per row-head; decode converts codes to
// fp16 in registers at D 128 and through fp16 tiles at D 64 (V) and 256 (K and V), keeping the
// scales outside the MMA, kernels/fp8_tiles.cuh), head dims 64, 128
// and 256, any H_q that is a multiple of H_kv. fp32 storage uses the reference kernel.
#pragma once

#include <cuda/stream_ref>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <type_traits>

#include "cellkv/attention_plan.hpp"
#include "cellkv/prefix_sharing.hpp"
#include "cellkv/gpu/error.hpp"
#include "cellkv/gpu/kernels/decode_attention.cuh"
#include "cellkv/gpu/kernels/dependent_launch.cuh"
#include "cellkv/gpu/kernels/prefill_attention.cuh"
#include "cellkv/gpu/kernels/prefill_wgmma.cuh"
#include "cellkv/gpu/kernels/shared_prefix_attention.cuh"
#include "cellkv/gpu/kernels/tile_rows.cuh"
#include "cellkv/gpu/kv_views.hpp"
#include "cellkv/gpu/launch/dispatch.cuh"
#include "cellkv/gpu/memory.hpp"
#include "cellkv/gpu/graph_scope.hpp"
#include "cellkv/gpu/step_views.hpp"
#include "cellkv/gpu/stream.hpp"

#ifndef CELLKV_DECODE_STAGES
#define CELLKV_DECODE_STAGES 3
#endif
#ifndef CELLKV_DECODE_WARPS
#define CELLKV_DECODE_WARPS 8
#endif
#ifndef CELLKV_DECODE_FP8_STAGES
#define CELLKV_DECODE_FP8_STAGES 3
#endif
#ifndef CELLKV_DECODE_FP8_WARPS
#define CELLKV_DECODE_FP8_WARPS 8
#endif
#ifndef CELLKV_DECODE_COLUMN_STAGES
#define CELLKV_DECODE_COLUMN_STAGES 2
#endif
#ifndef CELLKV_DECODE_COLUMN_WARPS
#define CELLKV_DECODE_COLUMN_WARPS 12
#endif

namespace cellkv::gpu {

// Element parameters (dtype.hpp) the table kernels serve: bf16 and fp16, stored as is or as fp8.
template <class T>
inline constexpr bool kTableKernelElement = std::is_same_v<InputOf<T>, __nv_bfloat16> || std::is_same_v<InputOf<T>, __half>;

template <class T>
bool table_kernels_support(std::int32_t head_dim, std::int32_t heads_q, std::int32_t heads_kv) {
  return kTableKernelElement<T> && (head_dim == 64 || head_dim == 128 || head_dim == 256) && heads_kv > 0 &&
         heads_q > 0 && heads_q % heads_kv == 0;
}

inline constexpr int kMaxDynamicSmem = 227 * 1024;

// The decode kernel's warps per block and stages per warp for head dim D and stored elements of
// `bytes` bytes: CELLKV_DECODE_WARPS and CELLKV_DECODE_STAGES (8 and 3; fp8: CELLKV_DECODE_FP8_*;
// fp8 with positions on the MMA's M side, `columns`: CELLKV_DECODE_COLUMN_*), fewer stages (not
// below 2), then fewer warps, where the block's shared memory would pass 227 KB (bf16 D = 256 gets
// 5 warps of 2 stages).
struct DecodeConfig {
  int warps = 0, stages = 0;
};
constexpr DecodeConfig decode_config(int head_dim, int bytes = 2, bool columns = false) {
  DecodeConfig c = columns       ? DecodeConfig{CELLKV_DECODE_COLUMN_WARPS, CELLKV_DECODE_COLUMN_STAGES}
                   : bytes == 1 ? DecodeConfig{CELLKV_DECODE_FP8_WARPS, CELLKV_DECODE_FP8_STAGES}
                                : DecodeConfig{CELLKV_DECODE_WARPS, CELLKV_DECODE_STAGES};
  const auto smem = [&](int stages) { return c.warps * kernels::decode_warp_smem_bytes(head_dim, stages, bytes); };
  while (smem(c.stages) > kMaxDynamicSmem) {
    if (c.stages > 2 && smem(2) <= kMaxDynamicSmem) --c.stages;
    else --c.warps;
  }
  return c;
}
template <int D, int Bytes = 2, bool Columns = false>
inline constexpr DecodeConfig kDecode = decode_config(D, Bytes, Columns);

template <int D>
inline constexpr int kPrefillStages = kernels::prefill_stages(D);

// The attention geometry of a cache's shard; shared_slots: partial slots of the shared-prefix
// kernel (0: the cache does not share prefixes; shared_slot_capacity in step_block.hpp).
struct TableShape {
  std::int32_t heads_q = 0, heads_kv = 0, head_dim = 0;
  std::int32_t shared_slots = 0;
};

// Work counts of one window buffer in the uploaded step (the host knows them from its plan).
struct WorkCounts {
  std::int32_t decode = 0, prefill = 0, shared = 0;
};

// T: the cache's element parameter (In, or Fp8<In>). Rows is kernels::TableRows (cell layout) or
// kernels::SlotRows (sequence layout).
template <class T, class Rows>
class TableAttention {
  using In = InputOf<T>;     // queries and outputs
  using S = StoredOf<T>;     // the pool's elements
  static constexpr int kBytes = kFp8Kv<T> ? 1 : 2;
  // Whether head dim D has the decode kernel with positions on the MMA's M side (fp8 at D = 128;
  // kernels/fp8_columns.cuh); it runs when H_q / H_kv <= kDecodeColumnRows (columns_).
  template <int D>
  static constexpr bool kColumnsKernel = kFp8Kv<T> && D == 128;
  template <int D, bool Columns = false>
  static constexpr DecodeConfig kDec = kDecode<D, kBytes, Columns>;
  template <int D, bool Columns = false>
  static constexpr int kDecSmem = kernels::decode_smem_bytes<D, kDec<D, Columns>.stages, kDec<D, Columns>.warps, kBytes>();
  template <int D, bool Columns>
  static constexpr auto* kDecodeKernel =
      kernels::decode_attention<In, D, kDec<D, Columns>.stages, kDec<D, Columns>.warps, Rows, S, Columns>;
  template <int D>
  static constexpr int kPreSmem = kernels::prefill_smem_bytes<D, kPrefillStages<D>, S>();
  template <int D>
  static constexpr bool kWgmmaPrefill = !kFp8Kv<T> && kernels::wgmma_prefill_supports(D);  // instantiated
  template <int D>
  static constexpr bool kWgmmaShared = !kFp8Kv<T> && kernels::wgmma_shared_supports(D);

 public:
  // Throws cellkv::gpu::Error when allocation or a CUDA query fails. Precondition: supported shape.
  explicit TableAttention(const TableShape& shape)
      : shape_(shape),
        columns_(kFp8Kv<T> && shape.head_dim == 128 && shape.heads_q <= kDecodeColumnRows * shape.heads_kv &&
                 !rows_decode_forced()) {
    int device = 0, sms = 0;
    CELLKV_CUDA_THROW(cudaGetDevice(&device));
    CELLKV_CUDA_THROW(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    wgmma_prefill_ = !kFp8Kv<T> && kernels::wgmma_prefill_supports(shape.head_dim) && wgmma_code_runs(device);
    (void)dispatch_head_dim(shape.head_dim, [&](auto d) { return size_grids<decltype(d)::value>(sms); });
    partial_o_ = DeviceBuffer<float>(static_cast<std::size_t>(slots_) * kDecodeRows * static_cast<std::size_t>(shape.head_dim));
    partial_lse_ = DeviceBuffer<float>(static_cast<std::size_t>(slots_) * kDecodeRows);
    merge_counts_ = DeviceBuffer<std::int32_t>(static_cast<std::size_t>(kernels::kMergeLevels) * static_cast<std::size_t>(slots_));
    // On the legacy default stream: the owning DeviceShard's constructor waits for it.
    CELLKV_CUDA_THROW(cudaMemset(merge_counts_.data(), 0, merge_counts_.bytes()));
    const auto shared_rows = static_cast<std::size_t>(shape.shared_slots) * static_cast<std::size_t>(shape.heads_q);
    shared_o_ = DeviceBuffer<float>(shared_rows * static_cast<std::size_t>(shape.head_dim));
    shared_lse_ = DeviceBuffer<float>(shared_rows);
    CELLKV_CUDA_THROW(cudaMemset(finish_sync_.data(), 0, finish_sync_.bytes()));  // waited for as merge_counts_
    CELLKV_CUDA_THROW(cudaMemset(prefill_claims_.data(), 0, prefill_claims_.bytes()));
  }

  // Whether prefill runs the Hopper (wgmma) kernel rather than the mma.sync one.
  [[nodiscard]] bool wgmma_prefill() const noexcept { return wgmma_prefill_; }
  // Whether decode runs the fp8 kernel with positions on the MMA's M side (decode items of
  // kDecodeColumnRows rows: fp8 pools at D = 128 with H_q / H_kv <= kDecodeColumnRows).
  [[nodiscard]] bool columns_decode() const noexcept { return columns_; }
  // Whether shared prefixes run shared_prefix_wgmma rather than shared_prefix_attention.
  [[nodiscard]] bool wgmma_shared() const noexcept { return wgmma_shared_; }

  // The geometry the host plans with: the decode tile (positions) and the rows of a prefill item,
  // those one block of the prefill kernel that runs takes at once (128 for prefill_wgmma, 64 for
  // prefill_attention). wgmma_prefill_ is final once the constructor has returned (size_grids may
  // turn it off), so every plan follows the kernel its launches run.
  [[nodiscard]] AttentionShape plan_shape() const noexcept {
    return {shape_.heads_q / shape_.heads_kv, decode_tile_positions(shape_.head_dim, kBytes),
            wgmma_prefill_ ? kPrefillRows : std::int32_t{kernels::kPrefillBlockRows}, decode_rows(), wgmma_prefill_};
  }

  // What the sharing planner needs: the kernel's geometry (the items and split alignment of the
  // shared-prefix kernel that runs) and the step block's capacities.
  static_assert(kernels::kWideTile / kSharedTile <= kMinSplitTiles, "a split of whole units for every split the planner allows");
  [[nodiscard]] SharingShape sharing_shape(std::int32_t max_runs) const noexcept {
    return {shape_.heads_q / shape_.heads_kv, shape_.heads_kv, shared_grid_, max_runs, shape_.shared_slots,
            wgmma_shared_ ? kPrefillRows : kSharedRows, wgmma_shared_ ? kernels::kWideTile / kSharedTile : 1,
            wgmma_shared_ ? kMaxFinishOwn : 0, wgmma_shared_ ? shared_grid_ * kernels::kFinishRowsPerBlock : 0,
            decode_rows()};
  }

  // One layer's attention through window buffer `buffer` of window `window`: q, out [width, H_q, D];
  // padding rows [T, width) of out become zeros. scale 0 means 1 / sqrt(D). Launches the kernels
  // the step needs (`work`); inside a stream capture, those of `graph` (graph_scope.hpp), and when
  // that is not every kernel, the launches check on the device that the replayed step needs no other.
  Status attend(std::int32_t buffer, std::int32_t window, const In* q, In* out, ReadView<S> pool, const Rows& rows,
                const StepBindings& b, std::int32_t tokens, std::int32_t width, WorkCounts work, StepKernels graph,
                float scale, ::cuda::stream_ref stream) const {
    if (scale == 0.f) scale = 1.f / std::sqrt(static_cast<float>(shape_.head_dim));
    const float scale_log2 = scale * kernels::kLog2e;
    const bool sharing = shape_.shared_slots > 0 && b.shared.counts != nullptr;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    CELLKV_CUDA_STATUS(cudaStreamIsCapturing(stream.get(), &capture));
    const StepKernels launched = capture != cudaStreamCaptureStatusNone
                                     ? graph
                                     : needed_kernels(work.decode, work.prefill, width > tokens, work.shared);
    const kernels::SharedFold fold = sharing ? kernels::SharedFold{b.shared.own_begin, b.shared.token_slots,
                                                                   shared_o_.data(), shared_lse_.data()}
                                             : kernels::SharedFold{};
    const kernels::LaunchGuard guard{capture != cudaStreamCaptureStatusNone ? graph : StepKernels::all(),
                                     b.fault + kFaultWordMissingKernel, b.tokens, width,
                                     sharing ? b.shared.counts : nullptr};
    const kernels::PrefillArgs<In, Rows, S> pre{q,      out,        pool,           rows, shape_.heads_q, scale_log2,
                                                window, b.segments, b.work[buffer], fold, guard};
    const kernels::DecodeArgs<In, Rows, S> dec{pre, b.tokens, width, partial_o_.data(), partial_lse_.data(),
                                               merge_counts_.data(), slots_};
    const kernels::SharedArgs<In, Rows, S> shared{pre,
                                                  b.shared,
                                                  b.token_pos,
                                                  shared_o_.data(),
                                                  shared_lse_.data(),
                                                  {finish_sync_.data(), finish_sync_.data() + 1}};
    const bool prefill = launched.has(StepKernels::kPrefill), decode = launched.has(StepKernels::kDecode);
    return dispatch_head_dim(shape_.head_dim, [&](auto d) -> Status {
      constexpr int D = decltype(d)::value;
      if (sharing && launched.has(StepKernels::kShared)) {  // before both: they fold its partials in
        if (const Status s = launch_shared<D>(shared, stream.get()); !s.ok()) return s;
      }
      if (prefill && decode) {  // fork: prefill on the side stream, decode here, then join
        if (const Status s = fork_.record(stream); !s.ok()) return s;
        if (const Status s = fork_.wait_on(side_); !s.ok()) return s;
        if (const Status s = launch_prefill<D>(pre, side_.get(), false); !s.ok()) return s;
        if (const Status s = join_.record(side_); !s.ok()) return s;
        if (const Status s = launch_decode<D>(dec, stream.get()); !s.ok()) return s;
        return join_.wait_on(stream);
      }
      if (prefill) return launch_prefill<D>(pre, stream.get(), dependent_);
      if (decode) return launch_decode<D>(dec, stream.get());
      return Status{};
    });
  }

 private:
  // Query rows of a decode item of the decode kernel that runs.
  std::int32_t decode_rows() const noexcept { return columns_ ? kDecodeColumnRows : kDecodeRows; }
  // Calls f(std::bool_constant<Columns>{}) for the decode kernel that runs at head dim D (columns:
  // columns_).
  template <int D, class F>
  static auto with_decode_kernel(bool columns, F&& f) {
    if constexpr (kColumnsKernel<D>) {
      if (columns) return f(std::true_type{});
    }
    return f(std::false_type{});
  }
  // CELLKV_DECODE_KERNEL=rows: fp8 at D = 128 decodes with the row form (16-row items) even where
  // the columns kernel would run (to compare the two in one process).
  static bool rows_decode_forced() {
    const char* e = std::getenv("CELLKV_DECODE_KERNEL");
    return e != nullptr && std::string_view(e) == "rows";
  }
  // CELLKV_PREFILL_TMA=0: the wgmma kernels gather every key and value row instead of loading
  // consecutive rows by TMA (to compare the two in one process).
  static bool prefill_tma_disabled() {
    const char* e = std::getenv("CELLKV_PREFILL_TMA");
    return e != nullptr && std::string_view(e) == "0";
  }
  // The TMA descriptors of a.pool for the wgmma kernels; none (every row gathered) where disabled.
  template <class Args>
  kernels::PoolMaps prefill_maps(const Args& a) const {
    return prefill_tma_ ? kernels::pool_maps(a.pool) : kernels::PoolMaps{};
  }
  // Whether `device` runs this build's sm_90a code (so wgmma), unless CELLKV_PREFILL_KERNEL=mma.
  static bool wgmma_code_runs(int device) {
    if (const char* e = std::getenv("CELLKV_PREFILL_KERNEL"); e != nullptr && std::string_view(e) == "mma") return false;
    int major = 0;
    CELLKV_CUDA_THROW(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    if (major != 9) return false;
    DeviceBuffer<int> flag(1);
    kernels::sm90a_probe<<<1, 1>>>(flag.data());
    CELLKV_CUDA_THROW(cudaGetLastError());
    int runs = 0;
    CELLKV_CUDA_THROW(cudaMemcpy(&runs, flag.data(), sizeof runs, cudaMemcpyDeviceToHost));
    return runs == 1;
  }

  // Grid sizes from occupancy (persistent grids of one wave) and the decode's partial slots.
  template <int D>
  Status size_grids(int sms) {
    with_decode_kernel<D>(columns_, [&](auto columns) { size_decode_grid<D, decltype(columns)::value>(sms); });
    return size_other_grids<D>(sms);
  }
  template <int D, bool Columns>
  void size_decode_grid(int sms) {
    auto* dec = kDecodeKernel<D, Columns>;
    constexpr int dec_smem = kDecSmem<D, Columns>;
    CELLKV_CUDA_THROW(cudaFuncSetAttribute(dec, cudaFuncAttributeMaxDynamicSharedMemorySize, dec_smem));
    int dec_blocks = 0;
    CELLKV_CUDA_THROW(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&dec_blocks, dec, kDec<D, Columns>.warps * 32, dec_smem));
    // At least one worker a KV head (the even split gives every head its own workers).
    decode_grid_ = std::max(sms * (dec_blocks > 0 ? dec_blocks : 1),
                            decode_min_blocks(shape_.heads_kv, kDec<D, Columns>.warps));
    slots_ = 2 * decode_grid_ * kDec<D, Columns>.warps;  // two partial slots per decode worker
  }
  template <int D>
  Status size_other_grids(int sms) {
    auto* pre = kernels::prefill_attention<In, D, kPrefillStages<D>, Rows, S>;
    constexpr int pre_smem = kPreSmem<D>;
    CELLKV_CUDA_THROW(cudaFuncSetAttribute(pre, cudaFuncAttributeMaxDynamicSharedMemorySize, pre_smem));
    int pre_blocks = 0;
    CELLKV_CUDA_THROW(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&pre_blocks, pre, kernels::kPrefillThreads, pre_smem));
    prefill_grid_ = sms * (pre_blocks > 0 ? pre_blocks : 1);
    auto* shared = kernels::shared_prefix_attention<In, D, kPrefillStages<D>, Rows, S>;
    CELLKV_CUDA_THROW(cudaFuncSetAttribute(shared, cudaFuncAttributeMaxDynamicSharedMemorySize, pre_smem));
    int shared_blocks = 0;
    CELLKV_CUDA_THROW(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&shared_blocks, shared, kernels::kPrefillThreads, pre_smem));
    shared_grid_ = sms * (shared_blocks > 0 ? shared_blocks : 1);
    if constexpr (kWgmmaPrefill<D>) {
      if (wgmma_prefill_) {  // one block per SM (its shared memory)
        wgmma_prefill_ = wgmma_kernel_fits(kernels::prefill_wgmma<In, D, Rows>, kernels::WgmmaPrefill<D>::kAllocation);
        if constexpr (kWgmmaShared<D>)
          wgmma_shared_ = wgmma_kernel_fits(kernels::shared_prefix_wgmma<In, D, Rows>, kernels::WgmmaPrefill<D>::kAllocation);
        if (wgmma_prefill_) prefill_grid_ = sms;
        if (wgmma_shared_) shared_grid_ = sms;
      }
    }
    return {};
  }

  // Raises `kernel`'s shared-memory limit to `smem`; whether the registers its warpgroups keep fit
  // what the block is launched with (a compiler that gave the kernel fewer would make setmaxnreg
  // wait; where they do not, the mma.sync kernel runs instead).
  template <class Kernel>
  static bool wgmma_kernel_fits(Kernel* kernel, int smem) {
    CELLKV_CUDA_THROW(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    cudaFuncAttributes attributes{};
    CELLKV_CUDA_THROW(cudaFuncGetAttributes(&attributes, kernel));
    return attributes.numRegs * kernels::kWgmmaPrefillThreads >= kernels::kWgmmaRegisterNeed;
  }

  // The dynamic shared-memory limit is raised right before each launch, in the same code as the
  // launch: a template kernel instantiated in several translation units has one registration per
  // unit, and an attribute set through one unit's kernel pointer does not reach another's.
  // Launches `kernel` with `smem` bytes of dynamic shared memory (the limit raised first), as a
  // dependent launch when `dependent` (every kernel of the layer's attention waits for the kernels
  // before it before reading what they write: kernels/dependent_launch.cuh).
  template <class Kernel, class... Args>
  static Status launch(Kernel* kernel, int grid, int threads, int smem, bool dependent, cudaStream_t stream,
                       const Args&... args) {
    CELLKV_CUDA_STATUS(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CELLKV_CUDA_STATUS(launch_dependent(dependent, kernel, grid, threads, static_cast<std::size_t>(smem), stream, args...));
    return {};
  }
  template <int D>
  Status launch_decode(const kernels::DecodeArgs<In, Rows, S>& a, cudaStream_t stream) const {
    return with_decode_kernel<D>(columns_, [&](auto columns) {
      return launch_decode_kernel<D, decltype(columns)::value>(a, stream);
    });
  }
  template <int D, bool Columns>
  Status launch_decode_kernel(const kernels::DecodeArgs<In, Rows, S>& a, cudaStream_t stream) const {
    return launch(kDecodeKernel<D, Columns>, decode_grid_, kDec<D, Columns>.warps * 32, kDecSmem<D, Columns>, dependent_,
                  stream, a);
  }
  // dependent: false on the side stream of a step with both kinds of segment (its first node
  // follows an event, not a kernel).
  template <int D>
  Status launch_prefill(const kernels::PrefillArgs<In, Rows, S>& a, cudaStream_t stream, bool dependent) const {
    if constexpr (kWgmmaPrefill<D>) {
      if (wgmma_prefill_)
        return launch(kernels::prefill_wgmma<In, D, Rows>, prefill_grid_, kernels::kWgmmaPrefillThreads,
                      kernels::WgmmaPrefill<D>::kAllocation, dependent, stream, a, prefill_maps(a),
                      kernels::ItemClaims{prefill_claims_.data()});
    }
    return launch(kernels::prefill_attention<In, D, kPrefillStages<D>, Rows, S>, prefill_grid_, kernels::kPrefillThreads,
                  kPreSmem<D>, dependent, stream, a);
  }
  template <int D>
  Status launch_shared(const kernels::SharedArgs<In, Rows, S>& a, cudaStream_t stream) const {
    if constexpr (kWgmmaShared<D>) {
      if (wgmma_shared_)
        return launch(kernels::shared_prefix_wgmma<In, D, Rows>, shared_grid_, kernels::kWgmmaPrefillThreads,
                      kernels::WgmmaPrefill<D>::kAllocation, dependent_, stream, a, prefill_maps(a));
    }
    return launch(kernels::shared_prefix_attention<In, D, kPrefillStages<D>, Rows, S>, shared_grid_,
                  kernels::kPrefillThreads, kPreSmem<D>, dependent_, stream, a);
  }

  TableShape shape_;
  bool columns_ = false;  // decode runs the kernel with positions on the MMA's M side (kColumnsKernel)
  bool dependent_ = dependent_launch_supported();  // the layer's kernels as dependent launches (sm_90+)
  bool wgmma_prefill_ = false;                     // prefill runs prefill_wgmma
  bool prefill_tma_ = !prefill_tma_disabled();     // the wgmma kernels load consecutive rows by TMA
  bool wgmma_shared_ = false;                      // shared prefixes run shared_prefix_wgmma
  int decode_grid_ = 0, prefill_grid_ = 0, shared_grid_ = 0;
  std::int32_t slots_ = 0;
  DeviceBuffer<float> partial_o_, partial_lse_;
  DeviceBuffer<std::int32_t> merge_counts_;
  DeviceBuffer<float> shared_o_, shared_lse_;  // [shared_slots][H_q][D], [shared_slots][H_q]
  DeviceBuffer<unsigned long long> finish_sync_{3};  // kernels::FinishSync: arrivals, claims [2]
  DeviceBuffer<std::uint32_t> prefill_claims_{2};     // kernels::ItemClaims of prefill_wgmma: next item, blocks done
  Stream side_;
  Event fork_, join_;
};

}  // namespace cellkv::gpu

// FAKE Ascend NPU for tests: PyTorch's PrivateUse1 device backed by host memory. Not torch_npu, not a real NPU.
// Storage, views and copies are here; every other op goes through PyTorch's CPU fallback (random ops are
// registered from Python so they draw from the fake device's own generator).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <ATen/core/VariableHooksInterface.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>
#include <torch/version.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

namespace fake_npu {
namespace {

constexpr auto kNpu = c10::DeviceType::PrivateUse1;
std::atomic<int64_t> g_allocated{0}, g_peak{0}, g_allocations{0};
std::atomic<int> g_device_count{1};
thread_local c10::DeviceIndex t_current = 0;

struct Block {
  void* data;
  size_t bytes;
};

void free_block(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  g_allocated -= static_cast<int64_t>(block->bytes);
  std::free(block->data);
  delete block;
}

struct HostAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t bytes) override {
    void* data = bytes ? std::aligned_alloc(64, (bytes + 63) / 64 * 64) : nullptr;
    TORCH_CHECK(!bytes || data, "fake npu: out of host memory allocating ", bytes, " bytes");
    int64_t now = g_allocated += static_cast<int64_t>(bytes);
    int64_t peak = g_peak.load();
    while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {}
    ++g_allocations;
    return {data, new Block{data, bytes}, &free_block, c10::Device(kNpu, t_current)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};
HostAllocator g_allocator;

struct Guard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kNpu; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kNpu, t_current); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.index() < g_device_count.load(), "fake npu: device ", int(d.index()), " of ",
                g_device_count.load());
    if (d.index() >= 0) t_current = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0) t_current = d.index();
  }
  c10::Stream getStream(c10::Device d) const noexcept override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, s.device());
  }
  c10::Stream getNewStream(c10::Device d, int) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  c10::DeviceIndex deviceCount() const noexcept override { return g_device_count.load(); }
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard);

// torch.Generator(device='npu'): a CPU generator (its state is the CPU generator's) that says it is the npu's; the
// fake's random kernels (_random.py) draw through a host generator carrying its state.
struct Generator final : at::CPUGeneratorImpl {
  explicit Generator(c10::DeviceIndex index) {
    device_ = c10::Device(kNpu, index < 0 ? t_current : index);
    key_set_ = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  }
};

// Pinned host memory: host allocations remembered while they live, so is_pinned() says true for them alone (as
// torch_npu's pinned allocator does), and code that keeps a pinned buffer only while it is pinned sees it kept.
std::mutex g_pinned_mutex;
std::unordered_set<const void*> g_pinned;

void free_pinned(void* data) {
  {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    g_pinned.erase(data);
  }
  std::free(data);
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t bytes) override {
    void* data = std::malloc(bytes ? bytes : 1);
    TORCH_CHECK(data, "FAKE npu: pinned host allocation of ", bytes, " bytes failed");
    {
      std::lock_guard<std::mutex> lock(g_pinned_mutex);
      g_pinned.insert(data);
    }
    return {data, data, &free_pinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const final { std::memcpy(dest, src, count); }
};
PinnedAllocator g_pinned_allocator;

struct Hooks final : at::PrivateUse1HooksInterface {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 7)  // hooks since torch 2.7
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
#endif
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  at::Device getDeviceFromPtr(void*) const override { return c10::Device(kNpu, t_current); }
  bool isPinnedPtr(const void* data) const override {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    return g_pinned.count(data) > 0;
  }
  at::Generator getNewGenerator(c10::DeviceIndex index) const override {
    return at::make_generator<Generator>(index);
  }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned_allocator; }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t bytes) const override {
    auto fresh = g_allocator.allocate(bytes);
    auto keep = std::min(bytes, storage.nbytes());
    if (keep) std::memcpy(fresh.get(), storage.data(), keep);
    storage.unsafeGetStorageImpl()->set_data_ptr_noswap(std::move(fresh));
    storage.unsafeGetStorageImpl()->set_nbytes(bytes);
  }
};

at::Tensor host_alias(const at::Tensor& t) {
  if (t.is_cpu()) return t;
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), at::TensorOptions().dtype(t.dtype()));
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout>, std::optional<at::Device> device, std::optional<bool>,
                               std::optional<at::MemoryFormat> memory_format) {
  c10::OptionalDeviceGuard guard(device);
  return at::detail::empty_generic(size, &g_allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout>, std::optional<at::Device> device, std::optional<bool>) {
  c10::OptionalDeviceGuard guard(device);
  return at::detail::empty_strided_generic(size, stride, &g_allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool) {
  host_alias(dst).copy_(host_alias(self));
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  at::native::resize_(dst, self.sizes());
  return copy_from(self, dst, false);
}

// Module.to('npu') keeps its Parameter objects (and megatron's attributes on them) only if CPU and npu tensors
// may share a TensorImpl type, as torch_npu declares for its own device.
bool compatible_shallow_copy(const at::Tensor& self, const at::Tensor& from) {
  auto dense = [](const at::Tensor& t) { return t.layout() == at::kStrided && (t.is_cpu() || t.is_privateuseone()); };
  return dense(self) && dense(from);
}

// Work on the fake device is synchronous: no stream can still be using a tensor.
void record_stream(at::Tensor&, c10::Stream) {}

void fallback_to_cpu(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  at::native::cpu_fallback(op, stack);
}

// Ops that have both a CPU kernel and a CompositeExplicitAutograd one (native_layer_norm, for one) would run
// the composite decomposition on this device, not the CPU kernel: other roundings than the CPU backend's. Each
// op named here runs its CPU kernel through the fallback instead (a real NPU has its own kernel for them).
torch::Library* g_cpu_routes = nullptr;

int64_t route_to_cpu_kernels(std::vector<std::string> names) {
  if (!g_cpu_routes) {
    g_cpu_routes = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__,
                                      __LINE__);
  }
  for (const auto& name : names) {
    g_cpu_routes->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback_to_cpu>());
  }
  return static_cast<int64_t>(names.size());
}

int64_t memory_allocated() { return g_allocated.load(); }
int64_t max_memory_allocated() { return g_peak.load(); }
int64_t allocations() { return g_allocations.load(); }
void reset_peak_memory_stats() { g_peak = g_allocated.load(); }
void set_device_count(int64_t n) { g_device_count = static_cast<int>(n); }
int64_t current_device() { return t_current; }
void set_device(int64_t i) { Guard().setDevice(c10::Device(kNpu, static_cast<c10::DeviceIndex>(i))); }

// torch 2.6 makes torch.Generator(device='npu') through this registration, not through the hooks' getNewGenerator.
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 7
at::Generator new_generator(c10::DeviceIndex index) { return at::make_generator<Generator>(index); }
REGISTER_GENERATOR_PRIVATEUSE1(new_generator)
#endif

// Ops with no autograd kernel of their own (c10d's collectives, custom ops) on npu tensors need a backend fallback
// for AutogradPrivateUse1: torch registers torch's own only in later releases (not 2.6 nor 2.7), and torch_npu
// registers the same one where torch does not.
void autograd_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  at::impl::GetVariableHooks()->basic_autograd_not_implemented_fallback(op, keys, stack);
}
torch::Library* g_autograd_fallback = nullptr;

struct Registrar {
  Registrar() {
    if (!c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(c10::DispatchKey::AutogradPrivateUse1)) {
      g_autograd_fallback =
          new torch::Library(torch::Library::IMPL, "_", c10::DispatchKey::AutogradPrivateUse1, __FILE__, __LINE__);
      g_autograd_fallback->fallback(torch::CppFunction::makeFromBoxedFunction<&autograd_fallback>());
    }
    c10::SetAllocator(kNpu, &g_allocator);
    static Hooks hooks;
    at::RegisterPrivateUse1HooksInterface(&hooks);
  }
};
Registrar g_registrar;

}  // namespace
}  // namespace fake_npu

TORCH_LIBRARY(fake_npu, m) {
  m.def("memory_allocated() -> int", &fake_npu::memory_allocated);
  m.def("max_memory_allocated() -> int", &fake_npu::max_memory_allocated);
  m.def("allocations() -> int", &fake_npu::allocations);
  m.def("reset_peak_memory_stats() -> ()", &fake_npu::reset_peak_memory_stats);
  m.def("set_device_count(int n) -> ()", &fake_npu::set_device_count);
  m.def("current_device() -> int", &fake_npu::current_device);
  m.def("set_device(int index) -> ()", &fake_npu::set_device);
  m.def("route_to_cpu_kernels(str[] names) -> int", &fake_npu::route_to_cpu_kernels);
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", &fake_npu::empty_memory_format);
  m.impl("empty_strided", &fake_npu::empty_strided);
  m.impl("as_strided", &at::native::as_strided_tensorimpl);
  m.impl("view", &at::native::view);
  m.impl("_reshape_alias", &at::native::_reshape_alias);
  m.impl("resize_", &at::native::resize_);
  m.impl("set_.source_Storage", &at::native::set_);
  m.impl("set_.source_Storage_storage_offset", &at::native::set_storage_cpu_);
  m.impl("_copy_from", &fake_npu::copy_from);
  m.impl("_copy_from_and_resize", &fake_npu::copy_from_and_resize);
  m.impl("record_stream", &fake_npu::record_stream);
  m.impl("_has_compatible_shallow_copy_type", &fake_npu::compatible_shallow_copy);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fake_npu::fallback_to_cpu>());
}

// serve_cpp: serves an AOTInductor package of dynamicemb tables from C++, with
// no Python interpreter.
//
//   serve_cpp PACKAGE.pt2 libdynamicemb_ops.so REQUESTS.safetensors
//             [--threads N] [--repeat R] [--warmup W] [--intra-op-threads K]
//             [--out OUT.safetensors] [--print P] [--json]
//
// The ops library is dlopen'ed first: its static initializers register the
// dynamicemb:: ops with torch's dispatcher, where the package's lookup calls
// them. Requests (`python -m dynamicemb.inference requests` writes them) hold
// tensors values.I, offsets.I and optionally weights.I for request I = 0, 1,
// ...: the package's inputs in TBE layout. N threads share one loaded package
// (N runners) and each serves every request R times; the first pass's
// outputs of every thread must be equal (bit for bit). Prints the first P
// outputs and the per-call latency percentiles; --out writes thread T's
// output of request I as out.T.I; --json adds the numbers as one JSON line.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/equal.h>
#include <dlfcn.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <latch>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "safetensors.h"

namespace {

struct Options {
  std::string package, ops, requests, out;
  int threads = 1, repeat = 1, warmup = 1, intra_op_threads = 0, print = 2;
  bool json = false;
};

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "serve_cpp: " << why << "\n"
            << "usage: serve_cpp PACKAGE.pt2 OPS_LIBRARY.so REQUESTS.safetensors [--threads N] [--repeat R]\n"
            << "                 [--warmup W] [--intra-op-threads K] [--out OUT.safetensors] [--print P] [--json]\n";
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  std::vector<std::string> pos;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) usage(a + " needs a value");
      return argv[++i];
    };
    auto count = [&](int min) {
      std::string v = next();
      int n = std::atoi(v.c_str());
      if (n < min) usage(a + " must be at least " + std::to_string(min) + ", not " + v);
      return n;
    };
    if (a == "--threads") o.threads = count(1);
    else if (a == "--repeat") o.repeat = count(1);
    else if (a == "--warmup") o.warmup = count(0);
    else if (a == "--intra-op-threads") o.intra_op_threads = count(1);
    else if (a == "--print") o.print = count(0);
    else if (a == "--out") o.out = next();
    else if (a == "--json") o.json = true;
    else if (a.rfind("--", 0) == 0) usage("unknown option " + a);
    else pos.push_back(a);
  }
  if (pos.size() != 3) usage("expected PACKAGE, OPS_LIBRARY and REQUESTS");
  o.package = pos[0], o.ops = pos[1], o.requests = pos[2];
  return o;
}

// Request I's inputs in the package's order: values, offsets[, weights].
std::vector<std::vector<at::Tensor>> load_requests(const std::string& path) {
  std::map<std::string, at::Tensor> by_name;
  for (auto& [name, t] : serve_cpp::read_safetensors(path)) by_name[name] = std::move(t);
  std::vector<std::vector<at::Tensor>> requests;
  for (size_t i = 0;; ++i) {
    auto find = [&](const char* what) -> const at::Tensor* {
      auto it = by_name.find(std::string(what) + "." + std::to_string(i));
      return it == by_name.end() ? nullptr : &it->second;
    };
    const at::Tensor *values = find("values"), *offsets = find("offsets"), *weights = find("weights");
    if (!values) break;
    if (!offsets) throw std::runtime_error(path + ": request " + std::to_string(i) + " has values but no offsets");
    requests.push_back({*values, *offsets});
    if (weights) requests.back().push_back(*weights);
  }
  if (requests.empty()) throw std::runtime_error(path + ": no requests (tensors values.0, offsets.0, ...)");
  return requests;
}

double percentile(const std::vector<double>& sorted, double q) {  // nearest rank
  size_t k = static_cast<size_t>(q * static_cast<double>(sorted.size()) + 0.999999);
  return sorted[std::min(sorted.size(), std::max<size_t>(k, 1)) - 1];
}

void print_output(size_t i, const at::Tensor& t) {
  std::cout << "request " << i << ": output " << t.sizes() << " " << t.scalar_type();
  if (t.scalar_type() == at::kFloat && t.is_contiguous()) {
    const float* p = t.const_data_ptr<float>();
    std::cout << " [";
    for (int64_t k = 0; k < std::min<int64_t>(t.numel(), 6); ++k) std::printf("%s%.4f", k ? ", " : "", p[k]);
    std::cout << (t.numel() > 6 ? ", ...]" : "]");
  }
  std::cout << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  try {
    // RTLD_GLOBAL: the ops' registrations and symbols stay for the package's .so.
    if (!dlopen(o.ops.c_str(), RTLD_NOW | RTLD_GLOBAL))
      throw std::runtime_error(std::string("cannot load the ops library: ") + dlerror());
    if (o.intra_op_threads > 0) at::set_num_threads(o.intra_op_threads);
    auto requests = load_requests(o.requests);
    using clock = std::chrono::steady_clock;
    auto t0 = clock::now();
    torch::inductor::AOTIModelPackageLoader loader(o.package, "model", false, static_cast<size_t>(o.threads));
    double load_s = std::chrono::duration<double>(clock::now() - t0).count();
    // What `python -m dynamicemb.inference package` stored: features, dims, tables, dtype.
    auto meta = loader.get_metadata();
    if (auto it = meta.find("dynamicemb.json"); it != meta.end() && o.print > 0) std::cout << "package: " << it->second << "\n";
    for (int w = 0; w < o.warmup; ++w)
      for (const auto& r : requests) loader.run(r);

    const size_t R = requests.size(), T = static_cast<size_t>(o.threads);
    std::vector<std::vector<at::Tensor>> outputs(T, std::vector<at::Tensor>(R));
    std::vector<std::vector<double>> latency(T);
    std::vector<std::string> errors(T);
    std::latch start(static_cast<std::ptrdiff_t>(T) + 1);
    std::vector<std::thread> pool;
    for (size_t t = 0; t < T; ++t) {
      pool.emplace_back([&, t] {
        start.arrive_and_wait();
        try {
          for (int pass = 0; pass < o.repeat; ++pass)
            for (size_t i = 0; i < R; ++i) {
              auto c0 = clock::now();
              auto out = loader.run(requests[i]);
              latency[t].push_back(std::chrono::duration<double, std::milli>(clock::now() - c0).count());
              if (pass == 0) outputs[t][i] = out.at(0);
            }
        } catch (const std::exception& e) {
          errors[t] = e.what();
        }
      });
    }
    auto w0 = clock::now();  // before the release: no thread starts earlier
    start.arrive_and_wait();
    for (auto& th : pool) th.join();
    double wall_s = std::chrono::duration<double>(clock::now() - w0).count();
    for (size_t t = 0; t < T; ++t)
      if (!errors[t].empty()) throw std::runtime_error("thread " + std::to_string(t) + ": " + errors[t]);

    size_t mismatches = 0;
    for (size_t t = 1; t < T; ++t)
      for (size_t i = 0; i < R; ++i)
        if (outputs[t][i].sizes() != outputs[0][i].sizes() || !at::equal(outputs[t][i], outputs[0][i])) ++mismatches;
    for (size_t i = 0; i < std::min<size_t>(R, static_cast<size_t>(o.print)); ++i) print_output(i, outputs[0][i]);

    std::vector<double> all;
    for (const auto& l : latency) all.insert(all.end(), l.begin(), l.end());
    std::sort(all.begin(), all.end());
    double mean = 0;
    for (double v : all) mean += v / static_cast<double>(all.size());
    std::printf("served %zu requests x %d repeats on %zu threads (intra-op threads %d) in %.3f s: %.1f requests/s\n",
                R, o.repeat, T, at::get_num_threads(), wall_s, static_cast<double>(all.size()) / wall_s);
    std::printf("latency ms: p50 %.3f  p90 %.3f  p99 %.3f  max %.3f  mean %.3f  (package loaded in %.2f s)\n",
                percentile(all, 0.5), percentile(all, 0.9), percentile(all, 0.99), all.back(), mean, load_s);
    std::printf("threads agree: %s (%zu mismatching outputs)\n", mismatches ? "NO" : "yes", mismatches);
    if (o.json)
      std::printf("{\"requests\": %zu, \"repeat\": %d, \"threads\": %zu, \"intra_op_threads\": %d, \"calls\": %zu, "
                  "\"wall_s\": %.6f, \"p50_ms\": %.6f, \"p90_ms\": %.6f, \"p99_ms\": %.6f, \"mean_ms\": %.6f, "
                  "\"load_s\": %.6f, \"mismatches\": %zu}\n",
                  R, o.repeat, T, at::get_num_threads(), all.size(), wall_s, percentile(all, 0.5),
                  percentile(all, 0.9), percentile(all, 0.99), mean, load_s, mismatches);
    if (!o.out.empty()) {
      std::vector<std::pair<std::string, at::Tensor>> named;
      for (size_t t = 0; t < T; ++t)
        for (size_t i = 0; i < R; ++i) named.emplace_back("out." + std::to_string(t) + "." + std::to_string(i), outputs[t][i]);
      serve_cpp::write_safetensors(o.out, named);
    }
    return mismatches ? 3 : 0;
  } catch (const std::exception& e) {
    std::cerr << "serve_cpp: " << e.what() << "\n";
    return 1;
  }
}

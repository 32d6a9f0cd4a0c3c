// Reads and writes safetensors files (https://github.com/huggingface/safetensors
// format: an 8-byte little-endian header length, a JSON header naming each
// tensor's dtype, shape and byte range, then the raw bytes), with at::Tensor
// on the CPU. Enough of JSON for that header; no dependency beyond ATen.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cctype>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace serve_cpp {

inline const std::vector<std::pair<std::string, at::ScalarType>>& dtype_names() {
  static const std::vector<std::pair<std::string, at::ScalarType>> names = {
      {"I64", at::kLong},   {"I32", at::kInt},      {"I16", at::kShort}, {"I8", at::kChar},  {"U8", at::kByte},
      {"F64", at::kDouble}, {"F32", at::kFloat},    {"F16", at::kHalf},  {"BF16", at::kBFloat16},
      {"BOOL", at::kBool}};
  return names;
}

// The subset of JSON a safetensors header uses: objects, arrays, strings and
// integers; a value is kept as its parsed children or its text.
struct Json {
  enum Kind { Object, Array, String, Number } kind = String;
  std::string text;
  std::vector<std::pair<std::string, Json>> members;  // Object (in order) or Array (empty names)

  const Json& at(const std::string& key) const {
    for (const auto& [k, v] : members)
      if (k == key) return v;
    throw std::runtime_error("safetensors header: missing \"" + key + "\"");
  }
  int64_t integer() const { return std::stoll(text); }
};

class JsonParser {
 public:
  explicit JsonParser(const std::string& s) : s_(s) {}
  Json parse() {
    Json v = value();
    skip();
    if (i_ != s_.size()) fail("trailing characters");
    return v;
  }

 private:
  void fail(const char* what) const {
    throw std::runtime_error(std::string("safetensors header: ") + what + " at byte " + std::to_string(i_));
  }
  void skip() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\r' || s_[i_] == '\t')) ++i_;
  }
  char peek() {
    skip();
    if (i_ >= s_.size()) fail("unexpected end");
    return s_[i_];
  }
  void expect(char c) {
    if (peek() != c) fail("unexpected character");
    ++i_;
  }
  std::string string() {
    expect('"');
    std::string out;
    while (i_ < s_.size() && s_[i_] != '"') {
      char c = s_[i_++];
      if (c == '\\') {
        if (i_ >= s_.size()) fail("unexpected end");
        char e = s_[i_++];
        out += e == 'n' ? '\n' : e == 't' ? '\t' : e;  // \" \\ \/ as themselves; names here are plain
      } else {
        out += c;
      }
    }
    expect('"');
    return out;
  }
  Json value() {
    Json v;
    char c = peek();
    if (c == '{' || c == '[') {
      v.kind = c == '{' ? Json::Object : Json::Array;
      char close = c == '{' ? '}' : ']';
      ++i_;
      if (peek() == close) {
        ++i_;
        return v;
      }
      while (true) {
        std::string key;
        if (v.kind == Json::Object) {
          key = string();
          expect(':');
        }
        v.members.emplace_back(std::move(key), value());
        if (peek() == ',') {
          ++i_;
          continue;
        }
        expect(close);
        return v;
      }
    }
    if (c == '"') {
      v.text = string();
      return v;
    }
    v.kind = Json::Number;
    size_t start = i_;
    while (i_ < s_.size() && (std::isdigit(static_cast<unsigned char>(s_[i_])) || s_[i_] == '-')) ++i_;
    if (i_ == start) fail("unsupported value");
    v.text = s_.substr(start, i_ - start);
    return v;
  }
  const std::string& s_;
  size_t i_ = 0;
};

// name -> tensor (CPU, contiguous), in the header's order.
inline std::vector<std::pair<std::string, at::Tensor>> read_safetensors(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open " + path);
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);  // little-endian, as this host
  if (!f || n > (uint64_t(1) << 30)) throw std::runtime_error(path + ": not a safetensors file");
  std::string header(n, '\0');
  f.read(header.data(), static_cast<std::streamsize>(n));
  if (!f) throw std::runtime_error(path + ": truncated header");
  Json root = JsonParser(header).parse();
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [name, info] : root.members) {
    if (name == "__metadata__") continue;
    at::ScalarType dtype = at::kFloat;
    bool known = false;
    for (const auto& [dn, dt] : dtype_names())
      if (dn == info.at("dtype").text) dtype = dt, known = true;
    if (!known) throw std::runtime_error(path + ": tensor " + name + " has unsupported dtype " + info.at("dtype").text);
    std::vector<int64_t> shape;
    for (const auto& d : info.at("shape").members) shape.push_back(d.second.integer());
    const auto& range = info.at("data_offsets").members;
    int64_t begin = range.at(0).second.integer(), end = range.at(1).second.integer();
    at::Tensor t = at::empty(shape, at::TensorOptions().dtype(dtype));
    if (static_cast<int64_t>(t.nbytes()) != end - begin)
      throw std::runtime_error(path + ": tensor " + name + "'s byte range does not match its shape");
    f.seekg(static_cast<std::streamoff>(8 + n + begin));
    f.read(static_cast<char*>(t.data_ptr()), end - begin);
    if (!f) throw std::runtime_error(path + ": tensor " + name + " is truncated");
    out.emplace_back(name, std::move(t));
  }
  return out;
}

inline void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  std::string header = "{";
  int64_t offset = 0;
  std::vector<at::Tensor> data;
  for (const auto& [name, t0] : tensors) {
    at::Tensor t = t0.contiguous();
    std::string dtype;
    for (const auto& [dn, dt] : dtype_names())
      if (dt == t.scalar_type()) dtype = dn;
    if (dtype.empty()) throw std::runtime_error("write_safetensors: unsupported dtype of " + name);
    std::string shape;
    for (int64_t d : t.sizes()) shape += (shape.empty() ? "" : ",") + std::to_string(d);
    int64_t nbytes = static_cast<int64_t>(t.nbytes());
    header += (header.size() > 1 ? "," : "") + ("\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":[" + shape +
                                               "],\"data_offsets\":[" + std::to_string(offset) + "," +
                                               std::to_string(offset + nbytes) + "]}");
    offset += nbytes;
    data.push_back(std::move(t));
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  std::ofstream f(path, std::ios::binary);
  uint64_t n = header.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f.write(header.data(), static_cast<std::streamsize>(n));
  for (const auto& t : data) f.write(static_cast<const char*>(t.const_data_ptr()), static_cast<std::streamsize>(t.nbytes()));
  if (!f) throw std::runtime_error("cannot write " + path);
}

}  // namespace serve_cpp

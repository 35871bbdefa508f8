// The fake NVRTC's source pass: turns a .cu source into the C++ that g++ compiles (the shim
// header is put in front separately). It
//  * rewrites `extern __shared__ T name[];` (which C++ cannot express) into a pointer to the
//    launch's dynamic shared memory,
//  * finds every `extern "C" __global__` function, to register it,
//  * notes whether the source uses any barrier or warp collective (if not, the executor runs
//    its threads as plain calls instead of fibers).
// Line structure is kept (each rewrite has as many newlines as the text it replaces), so a
// single `#line 1 "name.cu"` keeps g++'s messages on the .cu file's own lines.
// Used only by nvrtc.cpp; header-only so it stays one translation unit.
#pragma once
#include <algorithm>
#include <cctype>
#include <cstring>
#include <set>
#include <string>
#include <vector>

namespace fakecuda {
namespace rewrite {

struct Token {
    enum Kind { kIdent, kString, kChar, kNumber, kPunct } kind;
    size_t begin, end;
    bool directive;  // part of a preprocessor line
};

inline bool is_ident_start(char c) { return isalpha((unsigned char)c) || c == '_' || c == '$'; }
inline bool is_ident_char(char c) { return isalnum((unsigned char)c) || c == '_' || c == '$'; }

// Skips a quoted literal starting at s[i] (the quote); returns the index after it.
inline size_t skip_quoted(const std::string& s, size_t i) {
    char q = s[i++];
    while (i < s.size() && s[i] != q && s[i] != '\n') i += (s[i] == '\\') ? 2 : 1;
    return std::min(i + 1, s.size());
}

// Skips a raw string literal whose `"` is at s[i]; returns the index after it.
inline size_t skip_raw(const std::string& s, size_t i) {
    size_t open = s.find('(', i);
    if (open == std::string::npos) return s.size();
    std::string close = ")" + s.substr(i + 1, open - i - 1) + "\"";
    size_t end = s.find(close, open);
    return end == std::string::npos ? s.size() : end + close.size();
}

inline size_t skip_number(const std::string& s, size_t i) {
    while (i < s.size()) {
        char c = s[i];
        if ((c == '+' || c == '-') && strchr("eEpP", s[i - 1])) i++;
        else if (is_ident_char(c) || c == '.') i++;
        else if (c == '\'' && i + 1 < s.size() && is_ident_char(s[i + 1])) i++;
        else break;
    }
    return i;
}

// Tokens of `s`, without comments and whitespace.
inline std::vector<Token> tokenize(const std::string& s) {
    std::vector<Token> out;
    size_t i = 0, n = s.size();
    bool line_start = true, directive = false;
    auto emit = [&](Token::Kind k, size_t b, size_t e) {
        out.push_back(Token{k, b, e, directive});
        line_start = false;
    };
    while (i < n) {
        char c = s[i];
        if (c == '\n') {
            directive = false;
            line_start = true;
            i++;
        } else if (c == '\\' && i + 1 < n && (s[i + 1] == '\n' || s[i + 1] == '\r')) {
            i += (s[i + 1] == '\r' && i + 2 < n && s[i + 2] == '\n') ? 3 : 2;  // continuation
        } else if (isspace((unsigned char)c)) {
            i++;
        } else if (c == '/' && i + 1 < n && s[i + 1] == '/') {
            while (i < n && s[i] != '\n') i++;
        } else if (c == '/' && i + 1 < n && s[i + 1] == '*') {
            size_t e = s.find("*/", i + 2);
            i = e == std::string::npos ? n : e + 2;
        } else if (c == '#' && line_start) {
            directive = true;
            emit(Token::kPunct, i, i + 1);
            i++;
        } else if (c == '"') {
            bool raw = !out.empty() && out.back().kind == Token::kIdent && out.back().end == i &&
                       s[i - 1] == 'R';
            size_t e = raw ? skip_raw(s, i) : skip_quoted(s, i);
            if (raw) out.pop_back();
            emit(Token::kString, i, e);
            i = e;
        } else if (c == '\'') {
            size_t e = skip_quoted(s, i);
            emit(Token::kChar, i, e);
            i = e;
        } else if (isdigit((unsigned char)c) || (c == '.' && i + 1 < n && isdigit((unsigned char)s[i + 1]))) {
            size_t e = skip_number(s, i + 1);
            emit(Token::kNumber, i, e);
            i = e;
        } else if (is_ident_start(c)) {
            size_t e = i + 1;
            while (e < n && is_ident_char(s[e])) e++;
            emit(Token::kIdent, i, e);
            i = e;
        } else {
            emit(Token::kPunct, i, i + 1);
            i++;
        }
    }
    return out;
}

// What the pass produced.
struct Result {
    std::string body;                  // the rewritten source
    std::vector<std::string> kernels;  // extern "C" __global__ functions, in source order
    bool uses_sync = false;            // a barrier or warp collective appears somewhere
    std::string error;                 // non-empty: the source cannot be handled (a log line)
};

class Pass {
public:
    Pass(const std::string& src, const std::string& file) : s_(src), file_(file), t_(tokenize(src)) {}

    Result run() {
        scopes();
        for (size_t i = 0; i < t_.size() && res_.error.empty(); i++) {
            if (is_sync_word(text(i))) res_.uses_sync = true;
            if (t_[i].directive) continue;
            if (is(i, "__global__")) kernel_at(i);
            if (is(i, "extern") && is(i + 1, "__shared__")) extern_shared_at(i);
        }
        if (res_.error.empty()) apply_edits();
        return std::move(res_);
    }

private:
    struct Edit {
        size_t begin, end;
        std::string text;
    };

    const std::string& s_;
    std::string file_;
    std::vector<Token> t_;
    std::vector<int> depth_;     // per token: enclosing braces that are not extern "C"/namespace
    std::vector<bool> externc_;  // per token: inside an extern "C" { } block
    std::vector<Edit> edits_;
    std::set<std::string> seen_;
    Result res_;

    std::string text(size_t i) const {
        return i < t_.size() ? s_.substr(t_[i].begin, t_[i].end - t_[i].begin) : std::string();
    }
    bool is(size_t i, const char* w) const {
        if (i >= t_.size()) return false;
        size_t len = t_[i].end - t_[i].begin;
        return len == strlen(w) && s_.compare(t_[i].begin, len, w) == 0;
    }
    bool is_ident(size_t i) const { return i < t_.size() && t_[i].kind == Token::kIdent; }

    static bool is_sync_word(const std::string& w) {
        static const std::set<std::string> words = {
            "__syncthreads", "__syncthreads_count", "__syncthreads_and", "__syncthreads_or",
            "__syncwarp", "__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync",
            "__ballot_sync", "__any_sync", "__all_sync"};
        return w.size() > 6 && w[0] == '_' && words.count(w);
    }

    int line_of(size_t pos) const { return 1 + (int)std::count(s_.begin(), s_.begin() + pos, '\n'); }

    void fail(size_t tok, const std::string& what) {
        res_.error = file_ + ":" + std::to_string(line_of(t_[tok].begin)) + ": error: " + what + "\n";
    }

    // Computes depth_ and externc_: a brace opened by `extern "C" {` or `namespace x {` does not
    // leave file scope.
    void scopes() {
        std::vector<int> stack;  // 0: ordinary, 1: extern "C", 2: namespace
        int ordinary = 0, ec = 0;
        depth_.assign(t_.size(), 0);
        externc_.assign(t_.size(), false);
        for (size_t i = 0; i < t_.size(); i++) {
            depth_[i] = ordinary;
            externc_[i] = ec > 0;
            if (t_[i].directive) continue;
            if (is(i, "{")) {
                int kind = opens_namespace(i) ? 2 : (i >= 2 && is(i - 2, "extern") && is(i - 1, "\"C\"")) ? 1 : 0;
                stack.push_back(kind);
                ordinary += kind == 0;
                ec += kind == 1;
            } else if (is(i, "}") && !stack.empty()) {
                ordinary -= stack.back() == 0;
                ec -= stack.back() == 1;
                stack.pop_back();
            }
        }
    }

    bool opens_namespace(size_t brace) const {
        for (size_t j = brace; j-- > 0 && brace - j <= 8;) {
            if (is(j, "namespace")) return true;
            if (!is_ident(j) && !is(j, ":")) return false;
        }
        return false;
    }

    // The index after the parenthesised group that starts at t_[i] == "(".
    size_t skip_parens(size_t i) const {
        int d = 0;
        for (; i < t_.size(); i++) {
            if (is(i, "(")) d++;
            else if (is(i, ")") && --d == 0) return i + 1;
        }
        return i;
    }

    bool preceded_by_extern_c(size_t i) const {
        static const std::set<std::string> quals = {"__device__", "__host__", "static", "inline",
                                                    "__forceinline__", "__noinline__"};
        size_t j = i;
        while (j > 0 && is_ident(j - 1) && quals.count(text(j - 1))) j--;
        return j >= 2 && is(j - 1, "\"C\"") && is(j - 2, "extern");
    }

    // `__global__` at token i: registers the function if it has C linkage.
    void kernel_at(size_t i) {
        if (!externc_[i] && !preceded_by_extern_c(i)) return;  // templates, C++ linkage
        static const std::set<std::string> attrs = {"__launch_bounds__", "__attribute__",
                                                    "__align__", "alignas", "__declspec"};
        for (size_t j = i + 1; j < t_.size(); j++) {
            if (is(j, ";") || is(j, "{") || is(j, "}") || is(j, "=")) return;
            if (!is_ident(j) || !is(j + 1, "(")) continue;
            if (attrs.count(text(j))) {
                j = skip_parens(j + 1) - 1;
                continue;
            }
            if (seen_.insert(text(j)).second) res_.kernels.push_back(text(j));
            return;
        }
    }

    // The type of an `extern __shared__` declaration: tokens [from, to) minus alignment
    // attributes (the dynamic buffer is aligned to 128 bytes anyway).
    std::string type_text(size_t from, size_t to) const {
        std::string out;
        for (size_t j = from; j < to; j++) {
            if ((is(j, "__align__") || is(j, "alignas") || is(j, "__attribute__")) && is(j + 1, "(")) {
                j = skip_parens(j + 1) - 1;
                continue;
            }
            if (!out.empty()) out += ' ';
            out += text(j);
        }
        return out;
    }

    // `extern __shared__ T name[];` at token i.
    void extern_shared_at(size_t i) {
        size_t semi = i;
        while (semi < t_.size() && !is(semi, ";")) semi++;
        // expect: ... name [ ] ;
        if (semi >= t_.size() || semi < i + 6 || !is(semi - 1, "]") || !is(semi - 2, "[") ||
            !is_ident(semi - 3)) {
            fail(i, "fakecuda: unsupported extern __shared__ declaration (expected `extern "
                    "__shared__ T name[];`)");
            return;
        }
        std::string name = text(semi - 3), type = type_text(i + 2, semi - 3);
        if (type.empty()) {
            fail(i, "fakecuda: extern __shared__ declaration without a type");
            return;
        }
        std::string cast = "(" + type + "*)::fakecuda::dyn_smem()";
        std::string repl;
        if (depth_[i] > 0) {
            repl = type + "* const " + name + " = " + cast + ";";
        } else {
            // File scope: a function, and every later use of the name calls it.
            std::string fn = "fakecuda_dyn_" + name;
            repl = "static inline " + type + "* " + fn + "() { return " + cast + "; }";
            for (size_t j = semi + 1; j < t_.size(); j++)
                if (is(j, name.c_str())) edits_.push_back(Edit{t_[j].begin, t_[j].end, "(" + fn + "())"});
        }
        size_t b = t_[i].begin, e = t_[semi].end;
        repl.append(std::count(s_.begin() + b, s_.begin() + e, '\n'), '\n');
        edits_.push_back(Edit{b, e, repl});
    }

    void apply_edits() {
        std::sort(edits_.begin(), edits_.end(), [](const Edit& a, const Edit& b) { return a.begin < b.begin; });
        size_t pos = 0;
        for (const Edit& e : edits_) {
            if (e.begin < pos) continue;  // a later declaration's own name inside an earlier one
            res_.body.append(s_, pos, e.begin - pos);
            res_.body += e.text;
            pos = e.end;
        }
        res_.body.append(s_, pos, std::string::npos);
    }
};

inline Result run(const std::string& src, const std::string& file) { return Pass(src, file).run(); }

}  // namespace rewrite
}  // namespace fakecuda

#include "constraint.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <stdexcept>

#include "kdispatch/error.hpp"

namespace kdispatch {

namespace {

using Op = Constraint::Op;
using Node = Constraint::Node;
using Result = Constraint::Result;

// The kind of a value while compiling; `any` for a name that is not
// resolved (syntax-only compilation), which fits every operator.
enum class Kind : uint8_t { int_, bool_, dtype, any };

std::string_view kind_name(Kind k) {
  switch (k) {
    case Kind::int_: return "an integer";
    case Kind::bool_: return "a truth value";
    case Kind::dtype: return "a dtype";
    case Kind::any: break;
  }
  return "a value";
}

struct Token {
  enum class Type : uint8_t { end, number, name, punct } type = Type::end;
  std::string_view text;
  size_t column = 0;  // 1-based
  int64_t number = 0;
};

class Parser {
 public:
  Parser(std::string_view text, const ConstraintNames* names, std::vector<Node>& program,
         std::vector<Constraint::Name>& read)
      : text_(text), names_(names), program_(program), read_(read) {
    next();
  }

  void parse() {
    const Kind k = parse_or();
    if (tok_.type != Token::Type::end) refuse_here("an operator or the end of the expression");
    if (k != Kind::bool_ && k != Kind::any) {
      throw std::invalid_argument(fmt::format("the expression is {}, not a condition: compare it with one of "
                                              "==, !=, <, <=, >, >=",
                                              kind_name(k)));
    }
  }

 private:
  [[noreturn]] void refuse_here(std::string_view expected) const {
    throw std::invalid_argument(fmt::format("at column {}: expected {}, found {}", tok_.column, expected,
                                            tok_.type == Token::Type::end ? std::string("the end")
                                                                          : fmt::format("'{}'", tok_.text)));
  }
  void next() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
    tok_ = Token{};
    tok_.column = pos_ + 1;
    if (pos_ >= text_.size()) return;
    const char c = text_[pos_];
    const size_t start = pos_;
    if (std::isdigit(static_cast<unsigned char>(c))) {
      while (pos_ < text_.size() && std::isalnum(static_cast<unsigned char>(text_[pos_]))) ++pos_;
      tok_.type = Token::Type::number;
      tok_.text = text_.substr(start, pos_ - start);
      const auto [end, ec] = std::from_chars(tok_.text.data(), tok_.text.data() + tok_.text.size(), tok_.number);
      if (ec != std::errc() || end != tok_.text.data() + tok_.text.size()) {
        throw std::invalid_argument(fmt::format("at column {}: '{}' is not a decimal integer that fits in 64 bits",
                                                tok_.column, tok_.text));
      }
      return;
    }
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      while (pos_ < text_.size() && (std::isalnum(static_cast<unsigned char>(text_[pos_])) || text_[pos_] == '_')) {
        ++pos_;
      }
      tok_.type = Token::Type::name;
      tok_.text = text_.substr(start, pos_ - start);
      return;
    }
    static constexpr std::string_view kTwo[] = {"==", "!=", "<=", ">=", "&&", "||"};
    for (std::string_view p : kTwo) {
      if (text_.substr(pos_, 2) == p) {
        pos_ += 2;
        tok_.type = Token::Type::punct;
        tok_.text = p;
        return;
      }
    }
    if (std::string_view("+-*/%<>!()[],").find(c) == std::string_view::npos) {
      throw std::invalid_argument(fmt::format("at column {}: unexpected character '{}'", tok_.column, c));
    }
    ++pos_;
    tok_.type = Token::Type::punct;
    tok_.text = text_.substr(start, 1);
  }
  bool at(std::string_view s) const { return tok_.type != Token::Type::end && tok_.type != Token::Type::number && tok_.text == s; }
  bool accept(std::string_view s) {
    if (!at(s)) return false;
    next();
    return true;
  }
  void emit(Op op, int64_t value = 0) {
    if (program_.size() >= Constraint::kMaxNodes) {
      throw std::invalid_argument(fmt::format("longer than {} operations", Constraint::kMaxNodes));
    }
    program_.push_back({op, value});
  }
  void want(Kind got, Kind wanted, std::string_view op, size_t column) const {
    if (got == wanted || got == Kind::any) return;
    throw std::invalid_argument(fmt::format("at column {}: '{}' takes {}, got {}", column, op, kind_name(wanted),
                                            kind_name(got)));
  }
  static Kind join(Kind a, Kind b) { return a == Kind::any ? b : a; }

  // Parentheses, "not" and unary "-" recurse: their nesting is bounded, so
  // that a hostile manifest cannot exhaust the stack.
  struct Nested {
    explicit Nested(Parser& p) : parser(p) {
      if (++parser.nesting_ > Constraint::kMaxDepth) {
        throw std::invalid_argument(fmt::format("at column {}: nested deeper than {} levels", parser.tok_.column,
                                                Constraint::kMaxDepth));
      }
    }
    ~Nested() { --parser.nesting_; }
    Nested(const Nested&) = delete;
    Nested& operator=(const Nested&) = delete;
    Parser& parser;
  };

  Kind parse_or() {
    const Nested nested(*this);
    Kind k = parse_and();
    while (at("or") || at("||")) {
      const size_t column = tok_.column;
      const std::string_view op = tok_.text;
      next();
      want(k, Kind::bool_, op, column);
      const size_t jump = program_.size();
      emit(Op::or_jump);
      want(parse_and(), Kind::bool_, op, column);
      program_[jump].value = static_cast<int64_t>(program_.size());
      k = Kind::bool_;
    }
    return k;
  }
  Kind parse_and() {
    Kind k = parse_not();
    while (at("and") || at("&&")) {
      const size_t column = tok_.column;
      const std::string_view op = tok_.text;
      next();
      want(k, Kind::bool_, op, column);
      const size_t jump = program_.size();
      emit(Op::and_jump);
      want(parse_not(), Kind::bool_, op, column);
      program_[jump].value = static_cast<int64_t>(program_.size());
      k = Kind::bool_;
    }
    return k;
  }
  Kind parse_not() {
    if (at("not") || at("!")) {
      const Nested nested(*this);
      const size_t column = tok_.column;
      const std::string_view op = tok_.text;
      next();
      want(parse_not(), Kind::bool_, op, column);
      emit(Op::not_);
      return Kind::bool_;
    }
    return parse_comparison();
  }
  Kind parse_comparison() {
    const Kind lhs = parse_sum();
    static constexpr std::pair<std::string_view, Op> kCompare[] = {
        {"==", Op::eq}, {"!=", Op::ne}, {"<=", Op::le}, {">=", Op::ge}, {"<", Op::lt}, {">", Op::gt}};
    for (const auto& [text, op] : kCompare) {
      if (!at(text)) continue;
      const size_t column = tok_.column;
      next();
      const Kind rhs = parse_sum();
      if (op == Op::eq || op == Op::ne) {
        if (lhs != rhs && lhs != Kind::any && rhs != Kind::any) {
          throw std::invalid_argument(fmt::format("at column {}: '{}' compares {} with {}", column, text,
                                                  kind_name(lhs), kind_name(rhs)));
        }
      } else {
        want(lhs, Kind::int_, text, column);
        want(rhs, Kind::int_, text, column);
      }
      emit(op);
      return Kind::bool_;
    }
    if (at("in")) {
      const size_t column = tok_.column;
      next();
      if (!accept("[")) refuse_here("'[' after 'in'");
      int64_t count = 0;
      Kind item = lhs;
      do {
        const size_t item_column = tok_.column;
        const Kind k = parse_sum();
        if (k != Kind::any && item != Kind::any && k != item) {
          throw std::invalid_argument(fmt::format("at column {}: 'in' compares {} with {}", item_column,
                                                  kind_name(item), kind_name(k)));
        }
        item = join(item, k);
        ++count;
      } while (accept(","));
      if (!accept("]")) refuse_here("',' or ']'");
      if (item == Kind::bool_) {
        throw std::invalid_argument(fmt::format("at column {}: 'in' takes integers or dtypes", column));
      }
      emit(Op::in, count);
      return Kind::bool_;
    }
    return lhs;
  }
  Kind parse_sum() {
    Kind k = parse_product();
    while (at("+") || at("-")) {
      const size_t column = tok_.column;
      const std::string_view op = tok_.text;
      next();
      want(k, Kind::int_, op, column);
      want(parse_product(), Kind::int_, op, column);
      emit(op == "+" ? Op::add : Op::sub);
      k = Kind::int_;
    }
    return k;
  }
  Kind parse_product() {
    Kind k = parse_unary();
    while (at("*") || at("/") || at("%")) {
      const size_t column = tok_.column;
      const std::string_view op = tok_.text;
      next();
      want(k, Kind::int_, op, column);
      want(parse_unary(), Kind::int_, op, column);
      emit(op == "*" ? Op::mul : op == "/" ? Op::div : Op::mod);
      k = Kind::int_;
    }
    return k;
  }
  Kind parse_unary() {
    if (at("-")) {
      const Nested nested(*this);
      const size_t column = tok_.column;
      next();
      want(parse_unary(), Kind::int_, "-", column);
      emit(Op::neg);
      return Kind::int_;
    }
    return parse_primary();
  }
  Kind parse_primary() {
    if (tok_.type == Token::Type::number) {
      emit(Op::constant, tok_.number);
      next();
      return Kind::int_;
    }
    if (accept("(")) {
      const Kind k = parse_or();
      if (!accept(")")) refuse_here("')'");
      return k;
    }
    if (tok_.type != Token::Type::name) refuse_here("a number, a name or '('");
    static constexpr std::string_view kKeywords[] = {"and", "or", "not", "in"};
    if (std::find(std::begin(kKeywords), std::end(kKeywords), tok_.text) != std::end(kKeywords)) {
      refuse_here("a number, a name or '('");
    }
    const std::string_view name = tok_.text;
    const size_t column = tok_.column;
    next();
    if (name == "true" || name == "false") {
      emit(Op::constant, name == "true" ? 1 : 0);
      return Kind::bool_;
    }
    return resolve(name, column);
  }

  Kind resolve(std::string_view name, size_t column) {
    const auto read = [&](Op op, int64_t slot) {
      const bool seen = std::any_of(read_.begin(), read_.end(), [&](const auto& n) { return n.name == name; });
      if (!seen) read_.push_back({std::string(name), op, slot});
      emit(op, slot);
    };
    if (names_ != nullptr) {
      const auto& symbols = names_->symbols;
      if (const auto it = std::find(symbols.begin(), symbols.end(), name); it != symbols.end()) {
        read(Op::symbol, it - symbols.begin());
        return Kind::int_;
      }
      if (names_->symbols_only) {
        throw std::invalid_argument(fmt::format("at column {}: no tensor's shape has the symbol {} (symbols: [{}])",
                                                column, name, fmt::join(symbols, ", ")));
      }
      if (name == "dtype" || (!names_->dtype_var.empty() && name == names_->dtype_var)) {
        read(Op::dtype, 0);
        return Kind::dtype;
      }
      const auto& attrs = names_->attrs;
      const auto it = std::find_if(attrs.begin(), attrs.end(), [&](const AttrArg& a) { return a.name == name; });
      if (it != attrs.end()) {
        if (it->type == AttrType::int_) {
          read(Op::attr_int, it - attrs.begin());
          return Kind::int_;
        }
        if (it->type == AttrType::bool_) {
          read(Op::attr_bool, it - attrs.begin());
          return Kind::bool_;
        }
        throw std::invalid_argument(fmt::format("at column {}: attribute '{}' is a {}; a constraint reads int and "
                                                "bool attributes only",
                                                column, name, attr_type_name(it->type)));
      }
    } else if (name == "dtype") {
      read(Op::dtype, 0);
      return Kind::dtype;
    }
    if (const auto d = parse_dtype(name)) {
      emit(Op::constant, static_cast<int64_t>(*d));
      return Kind::dtype;
    }
    if (names_ == nullptr) {
      read(Op::symbol, 0);
      return Kind::any;
    }
    std::vector<std::string_view> attrs;
    for (const AttrArg& a : names_->attrs) attrs.push_back(a.name);
    throw std::invalid_argument(fmt::format(
        "at column {}: '{}' is not a shape symbol ([{}]), dtype ({}) or attribute ([{}]) of the op, nor a dtype "
        "name",
        column, name, fmt::join(names_->symbols, ", "),
        names_->dtype_var.empty() ? std::string("dtype") : fmt::format("dtype, {}", names_->dtype_var),
        fmt::join(attrs, ", ")));
  }

  std::string_view text_;
  const ConstraintNames* names_;
  std::vector<Node>& program_;
  std::vector<Constraint::Name>& read_;
  size_t pos_ = 0;
  size_t nesting_ = 0;
  Token tok_;
};

// The deepest the value stack gets along the program (a taken jump leaves
// the stack as deep as the path that does not take it).
size_t stack_depth(const std::vector<Node>& program) {
  size_t depth = 0;
  size_t max_depth = 0;
  for (const Node& n : program) {
    switch (n.op) {
      case Op::constant:
      case Op::symbol:
      case Op::attr_int:
      case Op::attr_bool:
      case Op::dtype: ++depth; break;
      case Op::neg:
      case Op::not_: break;
      case Op::in: depth -= static_cast<size_t>(n.value); break;
      default: --depth; break;
    }
    max_depth = std::max(max_depth, depth);
  }
  return max_depth;
}

}  // namespace

Constraint Constraint::compile(std::string_view text, const ConstraintNames* names) {
  if (text.size() > kMaxText) {
    throw std::invalid_argument(fmt::format("longer than {} characters", kMaxText));
  }
  Constraint c;
  c.text_ = std::string(text);
  Parser parser(c.text_, names, c.program_, c.names_);
  parser.parse();
  if (stack_depth(c.program_) > kMaxDepth) {
    throw std::invalid_argument(fmt::format("needs more than {} values at once (a shorter 'in' list, fewer "
                                            "operands)",
                                            kMaxDepth));
  }
  return c;
}

Constraint::Result Constraint::evaluate(const ConstraintInput& in) const noexcept {
  std::array<int64_t, kMaxDepth> stack;
  size_t sp = 0;
  const size_t n = program_.size();
  for (size_t pc = 0; pc < n; ++pc) {
    const Node& node = program_[pc];
    int64_t* const top = stack.data() + (sp == 0 ? 0 : sp - 1);  // the top value, for nodes that read one
    switch (node.op) {
      case Op::constant: stack[sp++] = node.value; break;
      case Op::symbol: stack[sp++] = in.symbols[node.value]; break;
      case Op::attr_int: stack[sp++] = in.attrs[node.value].value.i; break;
      case Op::attr_bool: stack[sp++] = in.attrs[node.value].value.b != 0 ? 1 : 0; break;
      case Op::dtype: stack[sp++] = static_cast<int64_t>(in.dtype); break;
      case Op::neg:
        if (*top == INT64_MIN) return Result::overflow;
        *top = -*top;
        break;
      case Op::not_: *top = *top == 0 ? 1 : 0; break;
      case Op::and_jump:
      case Op::or_jump:
        if ((*top != 0) == (node.op == Op::or_jump)) {
          pc = static_cast<size_t>(node.value) - 1;
        } else {
          --sp;
        }
        break;
      case Op::in: {
        const auto count = static_cast<size_t>(node.value);
        int64_t* x = top - count;
        const bool found = std::find(x + 1, top + 1, *x) != top + 1;
        sp -= count;
        *x = found ? 1 : 0;
        break;
      }
      default: {
        const int64_t b = *top;
        int64_t& a = top[-1];
        --sp;
        switch (node.op) {
          case Op::add:
            if (__builtin_add_overflow(a, b, &a)) return Result::overflow;
            break;
          case Op::sub:
            if (__builtin_sub_overflow(a, b, &a)) return Result::overflow;
            break;
          case Op::mul:
            if (__builtin_mul_overflow(a, b, &a)) return Result::overflow;
            break;
          case Op::div:
          case Op::mod:
            if (b == 0) return Result::division_by_zero;
            if (a == INT64_MIN && b == -1) return Result::overflow;
            a = node.op == Op::div ? a / b : a % b;
            break;
          case Op::eq: a = a == b; break;
          case Op::ne: a = a != b; break;
          case Op::lt: a = a < b; break;
          case Op::le: a = a <= b; break;
          case Op::gt: a = a > b; break;
          case Op::ge: a = a >= b; break;
          default: break;
        }
        break;
      }
    }
  }
  return sp == 1 && stack[0] != 0 ? Result::holds : Result::fails;
}

ConstraintSet compile_constraints(const KernelSpec& spec, const ConstraintNames& names) {
  ConstraintSet set;
  for (size_t i = 0; i < spec.constraints.size(); ++i) {
    try {
      set.constraints.push_back(Constraint::compile(spec.constraints[i], &names));
    } catch (const std::invalid_argument& e) {
      const std::string kernel =
          spec.is_runtime()
              ? fmt::format("kernel registered at run time for op '{}', backend '{}'", spec.op, spec.backend)
              : fmt::format("{}: kernel of op '{}' (symbol '{}')", spec.manifest, spec.op, spec.symbol);
      throw ManifestError(ErrorCode::manifest_bad_field, fmt::format("{}, \"constraints\"[{}] \"{}\": {}", kernel, i,
                                                                     spec.constraints[i], e.what()));
    }
  }
  return set;
}

std::string Constraint::explain(Result result, const ConstraintInput& in) const {
  std::vector<std::string> values;
  for (const Name& n : names_) {
    switch (n.op) {
      case Op::symbol: values.push_back(fmt::format("{} = {}", n.name, in.symbols[n.slot])); break;
      case Op::attr_int: values.push_back(fmt::format("{} = {}", n.name, in.attrs[n.slot].value.i)); break;
      case Op::attr_bool:
        values.push_back(fmt::format("{} = {}", n.name, in.attrs[n.slot].value.b != 0 ? "true" : "false"));
        break;
      default: values.push_back(fmt::format("{} = {}", n.name, dtype_name(in.dtype))); break;
    }
  }
  const std::string given = values.empty() ? std::string() : fmt::format(" ({})", fmt::join(values, ", "));
  switch (result) {
    case Result::holds: return fmt::format("constraint '{}' holds{}", text_, given);
    case Result::fails: return fmt::format("constraint '{}' is false{}", text_, given);
    case Result::overflow:
      return fmt::format("constraint '{}' cannot be evaluated: integer overflow{}", text_, given);
    case Result::division_by_zero:
      return fmt::format("constraint '{}' cannot be evaluated: division by zero{}", text_, given);
  }
  return {};
}

}  // namespace kdispatch

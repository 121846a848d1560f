// fmt's compiled part (what libfmt.so holds), built once into libforkguard from Debian's
// libfmt-dev headers: the library and the forkguard CLI need no libfmt.so, so the CLI can link
// the C++ runtime in (docs/performance.md, start-up), and no file pays for fmt's header-only mode
// (about 3.5 s more to compile each one). Hidden (CMakeLists.txt): libforkguard.so exports none
// of it, and a program that also links libfmt gets that one.
#include <fmt/format-inl.h>

FMT_BEGIN_NAMESPACE
namespace detail {

// The templates format.h declares and leaves to the compiled library.
template FMT_API locale_ref::locale_ref(const std::locale& loc);
template FMT_API auto locale_ref::get<std::locale>() const -> std::locale;
template FMT_API auto thousands_sep_impl(locale_ref) -> thousands_sep_result<char>;
template FMT_API auto decimal_point_impl(locale_ref) -> char;
template FMT_API void buffer<char>::append(const char*, const char*);
template FMT_API void vformat_to(buffer<char>&, string_view,
                                 basic_format_args<FMT_BUFFER_CONTEXT(char)>, locale_ref);

}  // namespace detail
FMT_END_NAMESPACE

// What the console shows of a rank's stream (launch/rank_output.hpp), without processes: the
// clock is passed in, so the '\r' states' timing is exact.
#include "launch/rank_output.hpp"

#include <gtest/gtest.h>

#include <string>

using forkguard::launch::detail::RankOutput;
using namespace std::chrono_literals;

namespace {

struct Console {
  RankOutput out{RankOutput::Options{.rank = 3, .prefix = true, .tail_lines = 2}};
  RankOutput::Clock::time_point now = RankOutput::Clock::time_point{} + 1h;
  std::string feed(std::string_view data) {
    std::string text;
    out.feed(data, now, text);
    return text;
  }
  std::string after(std::chrono::milliseconds ms) {
    now += ms;
    std::string text;
    out.show_due(now, text);
    return text;
  }
};

}  // namespace

TEST(RankOutput, LinesArePrefixedAndALineInPiecesIsShownOnceWhole) {
  Console c;
  EXPECT_EQ(c.feed("a line\nhalf"), "[rank3]:a line\n");
  EXPECT_EQ(c.after(10ms), "") << "not unfinished long enough to be shown";
  EXPECT_EQ(c.feed(" and the rest\r\n"), "[rank3]:half and the rest\n") << "CRLF ends a line";
  EXPECT_EQ(c.after(100ms), "");
}

TEST(RankOutput, CarriageReturnStatesAreShownLiveAtMostOnePerInterval) {
  Console c;
  EXPECT_EQ(c.feed("\r 1%"), "");
  EXPECT_EQ(c.after(30ms), "[rank3]: 1%\r") << "unfinished for 30 ms: shown as a state";
  EXPECT_EQ(c.feed("\r 2%\r 3%\r"), "") << "a '\\r' at the end may be half of \"\\r\\n\"";
  EXPECT_EQ(c.feed(" 4%"), "");
  EXPECT_EQ(c.after(30ms), "[rank3]: 4%\r") << "only the latest state";
  EXPECT_EQ(c.feed("\r"), "") << "the state shown already is not shown again";
  EXPECT_EQ(c.feed("100%\n"), "[rank3]:100%\n");
}

TEST(RankOutput, AnUnfinishedLineIsBoundedAndCloseEndsIt) {
  Console c;
  std::string big(RankOutput::kMaxPartial + 1, 'x');
  EXPECT_EQ(c.feed(big), "[rank3]:" + big + "\n") << "past 64 KiB it goes out as a line";
  EXPECT_EQ(c.feed("\rlast state\r"), "") << "its '\\r' may still become \"\\r\\n\"";
  std::string text;
  c.out.close(text);
  EXPECT_EQ(text, "[rank3]:last state\n") << "the stream's last state ends as a line";
  Console d;
  d.feed("no newline at the end");
  text.clear();
  d.out.close(text);
  EXPECT_EQ(text, "[rank3]:no newline at the end\n");
  EXPECT_EQ(d.out.tail().back(), "no newline at the end");
  EXPECT_EQ(d.out.tail().size(), 1u);
}

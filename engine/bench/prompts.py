"""Benchmark prompts: fresh salted random words, sized in tokens, and fixed KV-quality texts.

Fresh means no prefix cache can help: every prompt opens with a word that no earlier
prompt of the same factory opened with (a seeded permutation of the word list, started at
a seeded offset so that two runs against one server differ too), followed by seeded random
words. Two prompts of a run therefore share the BOS token and, where a tokenizer splits
two different openers into the same leading piece (some BPE vocabularies do for a few
words), that piece; a page-granular prefix cache never sees such a hit.

Sizing: with a tokenizer (in-process targets) the prompt is cut to exactly the requested
token count (BOS included) and sent as ids. Without one (HTTP) the factory is calibrated
once with the server's own count of a long sample (`usage.prompt_tokens`) and sizes
prompts by word count; the server's reported prompt_tokens is what the benchmarks print.
"""

from __future__ import annotations

import random
from typing import Any

from engine.bench.target import Prompt, Target
from engine.errors import InvalidRequest

WORDS = """
able about above across act add after again age ago air all almost alone along already
also always among angle animal answer any appear apple area arm arrive art ask atom baby
back bad ball band bank bar base basket bear beat bed before begin behind bell below best
better between big bird bit black block blood blue board boat body bone book born both
bottom box boy branch bread break bright bring broad brother brown build burn busy buy
call camp capital captain car card care carry case cat catch cause cell center century
chair chance change charge chart check chief child choose circle city claim class clean
clear climb clock close cloth cloud coast coat cold collect colony color column common
company compare complete copy corn corner cotton country course cover cow crop cross crowd
cry current cut dance dark day dead deal dear death decide deep degree desert design
differ dinner direct doctor dog dollar door double down draw dream dress drink drive drop
dry duck during each early earth east eat edge egg eight element end enemy engine enough
enter equal even evening event every exact example except excite expect experience eye
face fact fair fall family famous farm fast father favor fear feed feel feet field fight
figure fill final find fine finger finish fire first fish five flat floor flow flower fly
follow food foot force forest form forward four free fresh friend front fruit full game
garden gas gather gentle girl glad glass gold good govern grass gray great green ground
group grow guess guide gun hair half hand happen happy hard hat head hear heart heat heavy
help high hill history hold hole home hope horse hot hour house huge hunt ice idea inch
iron island job join joy jump keep key kind king kitchen knew lady lake land language large
last laugh law lead learn leave left leg letter level lift light line liquid list listen
""".split()


class PromptFactory:
    def __init__(self, seed: int, tokenizer: Any = None) -> None:
        self._rng = random.Random(seed)
        self._openers = list(WORDS)
        self._rng.shuffle(self._openers)
        self._next_opener = self._rng.randrange(len(self._openers))
        self.tokenizer = tokenizer
        self.tokens_per_word: float | None = None
        self.num_made = 0

    @classmethod
    async def for_target(cls, target: Target, seed: int) -> PromptFactory:
        """Exact sizing with the target's tokenizer; otherwise calibrated against it."""
        factory = cls(seed, target.tokenizer)
        if target.tokenizer is None:
            await factory.calibrate(target)
        return factory

    def words(self, num_words: int) -> str:
        """A fresh opener and num_words - 1 random words."""
        opener = self._openers[self._next_opener % len(self._openers)]
        if self.num_made >= len(self._openers):  # the openers came round: add one more word
            opener = f"{self._rng.choice(WORDS)} {opener}"
        self._next_opener += 1
        self.num_made += 1
        rest = self._rng.choices(WORDS, k=max(0, num_words - 1))
        return " ".join([opener, *rest])

    async def calibrate(self, target: Target, num_words: int = 400) -> float:
        """Tokens per word (BOS included in the count, so slightly high for short prompts)."""
        count = await target.count_tokens(self.words(num_words))
        self.tokens_per_word = count / num_words
        return self.tokens_per_word

    def make(self, num_tokens: int) -> Prompt:
        if num_tokens < 2:
            raise InvalidRequest(f"a benchmark prompt needs >= 2 tokens, got {num_tokens}")
        if self.tokenizer is not None:
            # Every word is at least one token, so num_tokens words always suffice.
            text = self.words(num_tokens)
            ids = self.tokenizer.encode(text, add_special=True, parse_special=False)
            ids = ids[:num_tokens]
            return Prompt(self.tokenizer.decode(ids, skip_special=True), tuple(ids))
        if self.tokens_per_word is None:
            raise InvalidRequest("the prompt factory needs a tokenizer or a calibration")
        return Prompt(self.words(max(1, round(num_tokens / self.tokens_per_word))))


# Fixed texts for `bench kv-quality`: three unrelated subjects, about 400 tokens each.
KV_QUALITY_TEXTS = (
    "The lighthouse at the end of the northern breakwater was built in 1874, after two "
    "winters in which the fishing fleet lost eleven boats on the rocks below the cliffs. "
    "The engineer who designed it, a quiet man named Aldous Perrin, insisted that the tower "
    "be made of granite blocks cut to interlock like the pieces of a puzzle, so that the "
    "waves would have no straight seam to work against. Each block was shaped at a quarry "
    "forty miles inland, numbered, carried to the coast by cart, and lowered into place "
    "from a wooden crane that stood on a barge when the weather allowed. Work could only "
    "proceed at low tide and in calm water, which meant that in the first summer the masons "
    "laid just nine courses. The keepers who later lived in the tower kept a log of every "
    "storm, every ship that passed, and every repair to the lamp. The early lamp burned "
    "whale oil and then paraffin; its light was concentrated by a great lens of glass "
    "prisms that turned on a bath of mercury, driven by a clockwork weight that a keeper had "
    "to wind every few hours through the night. Three families took turns at the station, "
    "and the children rowed to the village school when the sea was kind and stayed at home "
    "with their lessons when it was not. In 1931 the lamp was converted to electricity, and "
    "in 1978 the last keeper left, when an automatic beacon with a battery and a small "
    "generator replaced the crew. Today the tower still stands, its granite darkened by "
    "salt, and the old log books are kept in the harbor museum, where visitors can read "
    "the careful handwriting of men who counted the hours between dusk and dawn for more "
    "than a century. Local historians have compared the entries with newspaper reports "
    "and found that the keepers noted several rescues that were never reported elsewhere, "
    "including a night in 1907 when two keepers rowed out to a stranded schooner. The "
    "schooner's crew of six were brought ashore one at a time in a small boat while the "
    "third keeper held the lamp steady in a gale that broke two of the lantern windows. "
    "The harbor master later wrote that without the light and the two men in the boat, "
    "none of the sailors would have lived to see the morning, and the town raised money "
    "for a silver medal that the keepers' families still keep.",
    "A sourdough starter is a living culture of wild yeast and lactic acid bacteria, kept "
    "in a jar of flour and water and fed on a regular schedule. To begin one, mix equal "
    "weights of whole wheat flour and lukewarm water, cover the jar loosely, and leave it "
    "somewhere warm. For the first two days little seems to happen; then bubbles appear and "
    "the smell turns sharp, sometimes unpleasant, as different bacteria compete. Discard "
    "most of the mixture each day and feed what remains with fresh flour and water. After "
    "a week or two the population settles: the starter rises predictably within a few "
    "hours of feeding and smells pleasantly sour, like yogurt or green apples. The ratio "
    "of flour to water, called hydration, changes its behavior. A stiff starter ferments "
    "slowly and favors acetic acid, giving a tangier loaf; a liquid one is quicker and "
    "milder. Temperature matters as much as hydration: at twenty degrees Celsius a starter "
    "may peak after eight hours, while at twenty six it can peak in four. Bakers use the "
    "starter at or just before its peak, when the yeast is most active. For a simple loaf, "
    "combine one hundred grams of active starter with three hundred and fifty grams of "
    "water and five hundred grams of bread flour, rest the dough for half an hour, then add "
    "ten grams of salt. Over the next few hours fold the dough several times to build "
    "strength, shape it into a tight round, and let it rise in a basket lined with a "
    "floured cloth, overnight in the refrigerator if you like a more sour flavor. Bake it "
    "in a covered pot that has been heated for an hour, first with the lid on so that the "
    "steam keeps the crust soft while the loaf expands, then without the lid until the "
    "crust is deep brown. Let the bread cool completely before cutting it, because the "
    "crumb is still setting as the steam inside escapes, and a loaf cut too early turns "
    "gummy. A healthy starter can live for decades; some bakeries claim cultures that are "
    "more than a hundred years old. If you must leave yours for a few weeks, feed it, let "
    "it rise for an hour, and put it in the refrigerator, where it will sleep until you "
    "wake it with two or three warm feedings.",
    "When a computer sends data across the internet with the Transmission Control "
    "Protocol, the two ends first agree to talk through a three way handshake. The client "
    "sends a segment with the synchronize flag and an initial sequence number; the server "
    "answers with its own synchronize flag, its own sequence number, and an acknowledgment "
    "of the client's number plus one; the client then acknowledges the server. From that "
    "moment each byte of data carries a sequence number, and the receiver reports, with "
    "every acknowledgment, the next byte it expects. If a segment is lost, the sender "
    "notices either because a timer expires or because several duplicate acknowledgments "
    "arrive for the same byte, and it retransmits. Flow control keeps a fast sender from "
    "overwhelming a slow receiver: the receiver advertises a window, the number of bytes "
    "it is willing to buffer, and the sender never has more unacknowledged data in flight "
    "than that window allows. Congestion control protects the network itself. The sender "
    "keeps a congestion window that starts small and grows quickly during slow start, "
    "doubling every round trip, until it reaches a threshold or a loss occurs. After that "
    "it grows by roughly one segment per round trip, and when loss is detected it cuts the "
    "window, classically in half. Newer algorithms such as CUBIC grow the window as a "
    "cubic function of the time since the last loss, and BBR instead estimates the "
    "bottleneck bandwidth and the minimum round trip time and paces packets to match them. "
    "Closing a connection takes four segments, because each direction is shut down on its "
    "own: one side sends a finish flag, the other acknowledges it, and later sends its own "
    "finish flag, which is acknowledged in turn. The side that closed first then waits in "
    "a state called time wait for twice the maximum segment lifetime, so that any delayed "
    "segment from the old connection dies in the network before the same pair of ports "
    "can be used again. Servers that open and close many short connections can collect "
    "thousands of sockets in this state, which is one reason why protocols built on top "
    "of the transport, such as modern web protocols, prefer to keep one connection open "
    "and send many requests over it.",
)

"""The compile loop: search for a faster forward pass, prove it correct, publish it.

Data flow:
    model + TrafficProfile + hardware + budget (cli.py, or a CompileRun through worker.py)
      -> search_space.py: knobs of the stock forward pass, engine knobs, kernel tiles,
         source edits (source_edits.py)
      -> agents/ (sweep, evolve, bayes, llm) propose candidates concurrently -> board.py
         (append-only JSON lines: candidate, trial, result, verification, incumbent, note)
      -> loop.py: screen on the fast tier, confirm paired against the incumbent on the full
         tier, verify (gates.py -> the engine's verification suite), keep the incumbent
      -> evaluator.py: the real Evaluator over LLMEngine, hot reload and replay
      -> champion bundle + report.json/report.md + champions.py (local folder or ForwardPass)
    cost_model.py ranks parallel layouts (TP/EP/DP/PP) from specs and measured steps.
"""

"""One trial, from its claim to its tell: the context it runs in, the resources a worker keeps
for it, its plan (batch, accumulation, precision), its run as one object (context, plan and
resources, `run.TrialRun`), the drivers that train it, what it records and the executor that
maps every end of a trial to one outcome; and the study's timed step check that marks a model
x precision unusable before trials spend compute on it."""

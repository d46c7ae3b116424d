//! Which device runs which stage. Without interleaving each device (a stage thread, or a rank of
//! the pipeline) runs one stage. With the interleaved schedule (Narayanan et al. 2021,
//! Megatron-LM's virtual pipeline stages) the model is cut into `devices × virtual_stages`
//! stages and stage `s` runs on device `s mod devices`: device `d` holds stages `d`, `d + p`,
//! `d + 2p`, …, so a micro-batch loops through the devices `virtual_stages` times. The
//! embedding stays with stage 0 and the output layer with the last stage. What each schedule
//! allows of a placement is the schedule's rule ([`super::schedule`]).
use anyhow::Result;

use crate::error::usage;

/// `devices` devices holding `virtual_stages` stages each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    pub devices: usize,
    pub virtual_stages: usize,
}

impl Placement {
    /// One stage per device.
    pub fn one_stage_each(devices: usize) -> Placement {
        Placement { devices, virtual_stages: 1 }
    }

    /// The model's stages: `devices × virtual_stages`.
    pub fn stages(self) -> usize {
        self.devices * self.virtual_stages
    }

    /// The device that runs stage `stage`.
    pub fn device_of(self, stage: usize) -> usize {
        stage % self.devices
    }

    /// The stages device `device` holds, in model order.
    pub fn stages_of(self, device: usize) -> impl Iterator<Item = usize> {
        (0..self.virtual_stages).map(move |v| v * self.devices + device)
    }

    /// Refuses more virtual stages than a model of `nlayers` encoder layers can fill with one
    /// layer each. (One stage per device: [`super::Partition::even`] says so in its terms.)
    pub fn check_layers(self, nlayers: i64) -> Result<()> {
        if self.virtual_stages > 1 && (self.stages() as i64) > nlayers {
            return usage(format!(
                "{} devices × {} virtual stages need {} stages of at least one encoder layer each, but the model has {nlayers} \
                 (use fewer --devices, a smaller --virtual-stages or more --nlayers)",
                self.devices,
                self.virtual_stages,
                self.stages()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    // (The schedules' rules for a placement live in pipeline::schedule.)
    use crate::pipeline::Schedule;

    #[test]
    fn device_d_holds_every_p_th_stage_from_d() {
        let placement = Placement { devices: 3, virtual_stages: 2 };
        assert_eq!(placement.stages(), 6);
        assert_eq!(placement.stages_of(0).collect::<Vec<_>>(), [0, 3]);
        assert_eq!(placement.stages_of(2).collect::<Vec<_>>(), [2, 5]);
        assert!((0..6).all(|s| placement.stages_of(placement.device_of(s)).any(|held| held == s)));
        assert_eq!(Placement::one_stage_each(2).stages_of(1).collect::<Vec<_>>(), [1]);
    }

    #[test]
    fn what_the_interleaved_schedule_cannot_run_is_a_usage_error() {
        let two_by_two = Placement { devices: 2, virtual_stages: 2 };
        assert!(two_by_two.check(Schedule::Interleaved, 4).is_ok() && two_by_two.check_layers(4).is_ok());
        assert!(two_by_two.check_layers(5).is_ok(), "stages of unequal length are fine");
        let errors = [
            two_by_two.check_layers(3).unwrap_err(),
            two_by_two.check(Schedule::Interleaved, 3).unwrap_err(),
            two_by_two.check(Schedule::OneFOneB, 4).unwrap_err(),
            Placement { devices: 2, virtual_stages: 0 }.check(Schedule::Interleaved, 4).unwrap_err(),
        ];
        let messages = [
            "2 devices × 2 virtual stages need 4 stages of at least one encoder layer each, but the model has 3",
            "--chunks to be a multiple of the 2 pipeline devices, got 3",
            "--virtual-stages 2 needs --schedule interleaved",
            "--virtual-stages must be at least 1",
        ];
        for (err, message) in errors.iter().zip(messages) {
            assert!(format!("{err}").contains(message), "{err}");
            assert_eq!(crate::error::exit_code(err), 2);
        }
        assert_eq!(Placement::virtual_stages(Schedule::Interleaved, None).unwrap(), 2);
        assert_eq!(Placement::virtual_stages(Schedule::GPipe, None).unwrap(), 1);
        assert!(Placement::one_stage_each(3).check(Schedule::OneFOneB, 5).is_ok());
    }
}
